"""fleet.etcd's watch in a burst: it pauses and asks again from its last revision + 1, so etcd replays what came
meanwhile in few responses; no event is lost or reordered, a compaction or silence during a pause is noticed, and
the watch is live again once the burst is over."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from tests.support.aio import eventually
from tests.support.etcd_server import EtcdServer
from tests.support.tcp_relay import TcpRelay
from vllm_etcd_proxy.fleet.etcd import Compacted, EtcdClient, EtcdSettings, EtcdUnavailable, EventType, WatchBatch


@dataclass
class Writes:
    """What a burst wrote: each put's revision and key, and the keys deleted after their put."""

    puts: dict[int, bytes] = field(default_factory=dict)
    deleted: list[bytes] = field(default_factory=list)


async def _burst(client: EtcdClient, count: int, *, delete_every: int = 0, parallel: int = 16) -> Writes:
    writes, gate = Writes(), asyncio.Semaphore(parallel)

    async def one(i: int) -> None:
        key = f"/b/{i:05d}"
        async with gate:
            writes.puts[await client.put(key, f"v{i}")] = key.encode()
            if delete_every and i % delete_every == 0:
                await client.delete(key)
                writes.deleted.append(key.encode())

    await asyncio.gather(*(one(i) for i in range(count)))
    return writes


async def _watch(client: EtcdClient, start: int, batches: list[WatchBatch]) -> None:
    async with contextlib.aclosing(client.watch_prefix("/b/", start)) as watch:
        async for batch in watch:
            batches.append(batch)


def _check_complete_and_in_order(batches: list[WatchBatch], writes: Writes) -> None:
    events = [e for b in batches for e in b.events]
    assert len(events) == len(writes.puts) + len(writes.deleted)
    revisions = [e.kv.mod_revision for e in events]
    assert revisions == sorted(set(revisions)), "events repeated or out of order"
    assert {e.kv.mod_revision: e.kv.key for e in events if e.type is EventType.PUT} == writes.puts
    put_at = {key: rev for rev, key in writes.puts.items()}
    deletes = [(e.kv.key, e.kv.mod_revision) for e in events if e.type is EventType.DELETE]
    assert sorted(key for key, _ in deletes) == sorted(writes.deleted)
    assert all(rev > put_at[key] for key, rev in deletes)
    for batch in batches:
        if batch.events:
            assert batch.revision == batch.events[-1].kv.mod_revision, "the resume point is the last event"


@pytest.fixture
async def watched(etcd: EtcdServer) -> AsyncIterator[tuple[EtcdClient, list[WatchBatch]]]:
    """A writer client, and the batches of a watch with the default burst settings from the current revision."""
    async with EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,))) as client:
        batches: list[WatchBatch] = []
        task = asyncio.create_task(_watch(client, await client.put("/elsewhere", "x") + 1, batches))
        try:
            await eventually(lambda: bool(batches), 5.0, "the created batch")
            yield client, batches
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_burst_arrives_whole_in_order_and_in_far_fewer_responses_than_events(
    watched: tuple[EtcdClient, list[WatchBatch]],
) -> None:
    client, batches = watched
    writes = await _burst(client, 1500, delete_every=7)
    total = len(writes.puts) + len(writes.deleted)
    await eventually(lambda: sum(len(b.events) for b in batches) >= total, 5.0, "every event of the burst")
    _check_complete_and_in_order(batches, writes)
    responses = sum(1 for b in batches if b.events)
    assert responses < total / 5, f"{responses} responses for {total} events"
    # Quiet again: a lone put arrives as one live event.
    count = len(batches)
    revision = await client.put("/b/late", "v")
    await eventually(lambda: len(batches) > count and batches[-1].revision == revision, 2.0, "the late put")


async def test_a_replay_of_more_than_1000_revisions_resumes_after_its_last_event_not_its_header(
    etcd: EtcdServer,
) -> None:
    # etcd replays a watch started in the past in responses of at most 1,000 revisions, each headed with its
    # current revision: the first response (1,000 events) makes this watch pause, and it must resume after the
    # last event it got, or the other 500 are lost.
    settings = EtcdSettings(endpoints=(etcd.endpoint,), burst_events=5, burst_window=60)
    async with EtcdClient(settings) as client:
        start = await client.put("/elsewhere", "x") + 1
        writes = await _burst(client, 1500)
        batches: list[WatchBatch] = []
        task = asyncio.create_task(_watch(client, start, batches))
        try:
            await eventually(lambda: sum(len(b.events) for b in batches) >= 1500, 10.0, "every event")
            _check_complete_and_in_order(batches, writes)
            assert [len(b.events) for b in batches if b.events] == [1000, 500]
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_compaction_during_a_pause_raises_compacted(etcd: EtcdServer) -> None:
    settings = EtcdSettings(endpoints=(etcd.endpoint,), burst_events=3, burst_window=60, burst_pause=3)
    async with EtcdClient(settings) as client:
        start = await client.put("/elsewhere", "x") + 1
        await _burst(client, 3)
        with pytest.raises(Compacted):  # noqa: PT012 - the compaction comes while the watch runs
            async with contextlib.aclosing(client.watch_prefix("/b/", start)) as watch:
                seen = 0
                async for batch in watch:
                    seen += len(batch.events)
                    if seen == 3:  # the watch pauses now, and will ask again from the next revision
                        await client.put("/b/more", "v")
                        etcd.etcdctl("compact", str(await client.put("/b/more", "w")))
            raise AssertionError("the watch ended")


async def test_silence_during_a_pause_ends_the_watch_within_dead_after(etcd: EtcdServer) -> None:
    relay = TcpRelay(etcd.client_port)
    await relay.start()
    settings = EtcdSettings(
        endpoints=(relay.endpoint,), dead_after=0.6, burst_events=3, burst_window=60, burst_pause=30
    )
    try:
        async with EtcdClient(settings) as client, EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,))) as writer:
            batches: list[WatchBatch] = []
            task = asyncio.create_task(_watch(client, await writer.put("/elsewhere", "x") + 1, batches))
            await eventually(lambda: bool(batches), 5.0, "the created batch")
            await _burst(writer, 3)
            await eventually(lambda: sum(len(b.events) for b in batches) == 3, 5.0, "the events before the pause")
            await relay.partition()
            with pytest.raises(EtcdUnavailable, match="nothing heard"):
                await asyncio.wait_for(task, 5.0)
    finally:
        await relay.cut()
