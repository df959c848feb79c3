"""fleet.etcd's streams and silence: probes keep a healthy idle stream talking, so one that goes quiet (a silent
partition through a relay that drops every byte) is dead within ``dead_after``, and the lease outlives it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import pytest

from tests.support.aio import eventually, holds
from tests.support.etcd_server import EtcdServer
from tests.support.tcp_relay import TcpRelay
from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdSettings, EtcdUnavailable, WatchBatch

QUICK = 0.6
"""dead_after for these tests: probes every 0.2 s."""


@pytest.fixture
async def relay(etcd: EtcdServer) -> AsyncIterator[TcpRelay]:
    relay = TcpRelay(etcd.client_port)
    await relay.start()
    try:
        yield relay
    finally:
        await relay.cut()


def test_settings_refuse_a_dead_after_too_short_to_mean_anything() -> None:
    with pytest.raises(ValueError, match="dead_after"):
        EtcdSettings(endpoints=("127.0.0.1:2379",), dead_after=0.1)
    settings = EtcdSettings(endpoints=("127.0.0.1:2379",))
    assert settings.probe_interval == settings.dead_after / 3
    assert settings.lease_bound == settings.dead_after + settings.probe_interval


async def _watch(client: EtcdClient, start: int, batches: list[WatchBatch]) -> None:
    async with contextlib.aclosing(client.watch_prefix("/quiet/", start)) as watch:
        async for batch in watch:
            batches.append(batch)


async def test_an_idle_watch_outlives_dead_after_because_etcd_answers_its_progress_requests(etcd: EtcdServer) -> None:
    async with EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,), dead_after=QUICK)) as client:
        start = await client.put("/elsewhere", "x") + 1
        batches: list[WatchBatch] = []
        task = asyncio.create_task(_watch(client, start, batches))
        try:
            await eventually(lambda: bool(batches), 5.0, "the created batch")
            await holds(lambda: not task.done(), 6 * QUICK, "the idle watch")
            # Progress answers are proof of life, not batches: their revision is no safe resume point.
            assert [b.created for b in batches] == [True]
            revision = await client.put("/quiet/k", "v")
            await eventually(lambda: len(batches) == 2, 5.0, "the event")
            assert batches[1].revision == revision and batches[1].events[0].kv.key == b"/quiet/k"
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_watch_behind_a_silent_partition_ends_within_dead_after(relay: TcpRelay) -> None:
    async with EtcdClient(EtcdSettings(endpoints=(relay.endpoint,), dead_after=QUICK)) as client:
        batches: list[WatchBatch] = []
        task = asyncio.create_task(_watch(client, 1, batches))
        await eventually(lambda: bool(batches), 5.0, "the created batch")
        await relay.partition()
        cut = time.monotonic()
        with pytest.raises(EtcdUnavailable, match="nothing heard"):
            await asyncio.wait_for(task, QUICK + 5.0)
        assert time.monotonic() - cut < QUICK + 1.0
        assert relay.dropped > 0, "the probes went on into the partition"


async def test_keep_alive_through_a_silent_partition_shorter_than_ttl_minus_the_bound_keeps_the_lease(
    etcd: EtcdServer, relay: TcpRelay, caplog: pytest.LogCaptureFixture
) -> None:
    settings = EtcdSettings(endpoints=(relay.endpoint,), dead_after=QUICK)
    ttl = 3
    async with EtcdClient(settings) as client, EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,))) as direct:
        lease = await client.grant(ttl)
        await direct.put("/leased", "v", lease=lease)
        refreshed: list[float] = []
        keeper = asyncio.create_task(client.keep_alive(lease, ttl, lambda _: refreshed.append(time.monotonic())))
        try:
            await eventually(lambda: bool(refreshed), 3.0, "first refresh")
            with caplog.at_level(logging.WARNING, "vllm_etcd_proxy.fleet.etcd.streams"):
                await relay.partition()
                cut = time.monotonic()
                await eventually(lambda: "keepalive failed" in caplog.text, QUICK + 2.0, "the dead stream noticed")
                await holds(
                    lambda: not keeper.done(),
                    ttl - settings.lease_bound - 0.5 - (time.monotonic() - cut),
                    "the keep-alive",
                )
                await relay.heal()
                await eventually(lambda: refreshed[-1] > time.monotonic() - 0.5, QUICK + 2.0, "a refresh after healing")
            await holds(lambda: not keeper.done(), ttl, "the keep-alive")
            assert await direct.get("/leased") is not None
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper


async def test_behind_a_silent_partition_both_streams_move_to_the_next_endpoint(
    etcd: EtcdServer, relay: TcpRelay
) -> None:
    settings = EtcdSettings(endpoints=(relay.endpoint, etcd.endpoint), dead_after=QUICK)
    async with EtcdClient(settings) as client:
        lease = await client.grant(5)
        refreshed: list[float] = []
        keeper = asyncio.create_task(client.keep_alive(lease, 5, lambda _: refreshed.append(time.monotonic())))
        batches: list[WatchBatch] = []
        watcher = asyncio.create_task(_watch(client, 1, batches))
        try:
            await eventually(lambda: bool(refreshed) and bool(batches), 5.0, "a refresh and the created batch")
            await relay.partition()
            cut = time.monotonic()
            with pytest.raises(EtcdUnavailable):
                await asyncio.wait_for(watcher, QUICK + 5.0)
            assert client.current_endpoint == etcd.endpoint
            await eventually(lambda: refreshed[-1] > cut + QUICK, QUICK + 2.0, "a refresh through the other member")
            batches = []
            watcher = asyncio.create_task(_watch(client, 1, batches))
            await eventually(lambda: bool(batches), 5.0, "a watch through the other member")
            assert not keeper.done()
        finally:
            for task in (keeper, watcher):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, EtcdUnavailable):
                    await task
