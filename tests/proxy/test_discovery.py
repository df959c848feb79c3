"""Discovery feeding the real pool from a real etcd: list-then-watch, resume, re-list, invalid records,
failover, partitions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Sequence

import pytest

from tests.support.aio import eventually
from tests.support.etcd_cluster import EtcdCluster
from tests.support.etcd_server import EtcdServer
from tests.support.tcp_relay import TcpRelay
from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdSettings
from vllm_etcd_proxy.fleet.records import KeyLayout, Node, Role
from vllm_etcd_proxy.proxy.discovery.events import DiscoveryState, PoolEvent, Remove, Snapshot, Upsert
from vllm_etcd_proxy.proxy.discovery.pool import Pool
from vllm_etcd_proxy.proxy.discovery.watch import Discovery

LAYOUT = KeyLayout()
PREFILL = LAYOUT.key(Role.PREFILL, "127.0.0.1:8100")
DECODE = LAYOUT.key(Role.DECODE, "127.0.0.1:8200")
MIXED = LAYOUT.key(Role.MIXED, "127.0.0.1:8300")


def record(role: str, url: str, **extra: object) -> str:
    return json.dumps({"url": url, "role": role, "models": ["m"], **extra})


INVALID_VALUES = {
    LAYOUT.key(Role.DECODE, "127.0.0.11:1"): b"\xff\xfe not utf-8",
    LAYOUT.key(Role.DECODE, "127.0.0.12:1"): b"{not json",
    LAYOUT.key(Role.DECODE, "127.0.0.13:1"): record("prefill", "http://127.0.0.13:1").encode(),
    LAYOUT.key(Role.DECODE, "127.0.0.14:1"): record("decode", "ftp://127.0.0.14:1").encode(),
    LAYOUT.key(Role.DECODE, "not-a-host-port"): b"",
    LAYOUT.cluster_prefix + "gpu/127.0.0.15:1": b"",
}
"""Each one a different reason for a record to be ignored."""


class Recorded:
    """The replica's real pool, fed by discovery, and every event it was given."""

    def __init__(self) -> None:
        self.real = Pool()
        self.events: list[PoolEvent] = []

    def apply(self, events: Sequence[PoolEvent]) -> None:
        self.events.extend(events)
        self.real.apply_all(events)

    @property
    def nodes(self) -> dict[str, Node]:
        """The pool's nodes by etcd key."""
        return {state.entry_key: state.node for state in self.real.all()}

    def snapshots(self) -> int:
        return sum(isinstance(e, Snapshot) for e in self.events)


class Running:
    def __init__(self, pool: Recorded, state: DiscoveryState, task: asyncio.Task[None]):
        self.pool, self.state, self.task = pool, state, task


@contextlib.asynccontextmanager
async def discovering(settings: EtcdSettings) -> AsyncIterator[Running]:
    pool, state = Recorded(), DiscoveryState()
    async with EtcdClient(settings) as client:
        task = asyncio.create_task(Discovery(client, LAYOUT, pool.apply, state, backoff_max=0.5).run())
        try:
            await eventually(lambda: state.synced and state.connected, 10.0, "discovery synced")
            yield Running(pool, state, task)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert not task.done() or task.cancelled()


@pytest.fixture
async def writer(etcd: EtcdServer) -> AsyncIterator[EtcdClient]:
    async with EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,))) as client:
        yield client


async def test_snapshot_then_watch_upserts_and_removes(etcd: EtcdServer, writer: EtcdClient) -> None:
    await writer.put(PREFILL, record("prefill", "http://127.0.0.1:8100"))
    async with discovering(EtcdSettings(endpoints=(etcd.endpoint,))) as run:
        assert set(run.pool.nodes) == {PREFILL}
        assert isinstance(run.pool.events[0], Snapshot)
        await writer.put(DECODE, record("decode", "http://127.0.0.1:8200"))
        await eventually(lambda: DECODE in run.pool.nodes, 5.0, "decode upserted")
        assert await writer.delete(PREFILL) == 1
        revision, _ = await writer.get_prefix("/none/")  # etcd's current revision
        await eventually(lambda: PREFILL not in run.pool.nodes, 5.0, "prefill removed")
        await eventually(lambda: run.state.revision >= revision, 5.0, "state revision")
        assert run.state.endpoint == etcd.endpoint and run.state.last_error == ""
        assert run.state.resyncs == 0 and run.pool.snapshots() == 1


async def test_bare_empty_value_means_a_serving_node_at_its_id(etcd: EtcdServer, writer: EtcdClient) -> None:
    await writer.put(DECODE, b"")
    async with discovering(EtcdSettings(endpoints=(etcd.endpoint,))) as run:
        node = run.pool.nodes[DECODE]
        assert node.url == "http://127.0.0.1:8200" and node.role is Role.DECODE and node.learn_models
        await writer.put(MIXED, b"")
        await eventually(lambda: MIXED in run.pool.nodes, 5.0, "bare mixed key")


async def test_invalid_values_are_ignored_and_counted_while_valid_nodes_stay(
    etcd: EtcdServer, writer: EtcdClient
) -> None:
    await writer.put(PREFILL, record("prefill", "http://127.0.0.1:8100"))
    listed = list(INVALID_VALUES.items())[:3]
    watched = list(INVALID_VALUES.items())[3:]
    for key, value in listed:
        await writer.put(key, value)
    async with discovering(EtcdSettings(endpoints=(etcd.endpoint,))) as run:
        assert set(run.pool.nodes) == {PREFILL}
        assert run.state.invalid_total == len(listed)
        for key, value in watched:
            await writer.put(key, value)
        await writer.put(DECODE, record("decode", "http://127.0.0.1:8200"))
        await eventually(lambda: DECODE in run.pool.nodes, 5.0, "valid node after invalid ones")
        assert set(run.pool.nodes) == {PREFILL, DECODE}
        assert run.state.invalid_total == len(INVALID_VALUES)
        assert set(run.state.invalid_records) == set(INVALID_VALUES)
        assert all(run.state.invalid_records.values())
        # A valid node whose value turns invalid disappears; fixing it brings it back.
        await writer.put(PREFILL, b"[]")
        await eventually(lambda: PREFILL not in run.pool.nodes, 5.0, "node with invalid value removed")
        assert PREFILL in run.state.invalid_records
        await writer.put(PREFILL, record("prefill", "http://127.0.0.1:8100"))
        await eventually(lambda: PREFILL in run.pool.nodes, 5.0, "fixed node back")
        assert PREFILL not in run.state.invalid_records
        assert not run.task.done()


async def test_resumes_after_etcd_kill_and_restart_without_losing_events(etcd: EtcdServer, writer: EtcdClient) -> None:
    await writer.put(PREFILL, record("prefill", "http://127.0.0.1:8100"))
    async with discovering(EtcdSettings(endpoints=(etcd.endpoint,), timeout=2.0)) as run:
        etcd.kill()
        await eventually(lambda: not run.state.connected, 5.0, "watch noticed etcd died")
        assert run.state.last_error
        etcd.stop()  # reaps the killed process and closes its log; the data dir stays
        etcd.start()
        # Written before discovery is back: it must arrive as watch events, not through a re-list.
        await writer.put(DECODE, record("decode", "http://127.0.0.1:8200"))
        await writer.delete(PREFILL)
        await eventually(lambda: set(run.pool.nodes) == {DECODE}, 10.0, "events written during the outage")
        assert run.state.connected and run.state.reconnects >= 1
        assert run.state.resyncs == 0 and run.pool.snapshots() == 1
        assert [type(e) for e in run.pool.events[-2:]] == [Upsert, Remove]


async def test_compaction_during_a_partition_relists_and_drops_the_deleted_node(
    etcd: EtcdServer, writer: EtcdClient
) -> None:
    relay = TcpRelay(etcd.client_port)
    await relay.start()
    try:
        await writer.put(PREFILL, record("prefill", "http://127.0.0.1:8100"))
        await writer.put(DECODE, record("decode", "http://127.0.0.1:8200"))
        async with discovering(EtcdSettings(endpoints=(relay.endpoint,), timeout=2.0)) as run:
            await relay.cut()
            await eventually(lambda: not run.state.connected, 5.0, "watch noticed the partition")
            await writer.delete(PREFILL)
            await writer.put(MIXED, b"")
            etcd.etcdctl("compact", str(await writer.put("/elsewhere", "bump")))
            await relay.restore()
            await eventually(lambda: set(run.pool.nodes) == {DECODE, MIXED}, 10.0, "re-listed pool")
            assert run.state.resyncs == 1 and run.pool.snapshots() == 2
            await eventually(lambda: run.state.connected, 5.0, "watching again")
    finally:
        await relay.cut()


async def test_relists_when_etcd_comes_back_wiped(etcd: EtcdServer) -> None:
    settings = EtcdSettings(endpoints=(etcd.endpoint,), timeout=2.0)
    async with EtcdClient(settings) as writer:
        for i in range(5):
            await writer.put(LAYOUT.key(Role.DECODE, f"127.0.0.1:{8200 + i}"), b"")
    async with discovering(settings) as run:
        assert len(run.pool.nodes) == 5
        before = run.state.revision
        etcd.wipe()
        await eventually(lambda: not run.state.connected, 5.0, "watch noticed etcd died")
        etcd.start()
        async with EtcdClient(settings) as writer:
            await writer.put(MIXED, b"")
            assert (await writer.get_prefix("/none/"))[0] < before
        await eventually(lambda: set(run.pool.nodes) == {MIXED}, 10.0, "pool replaced by the wiped etcd's keys")
        assert run.state.resyncs >= 1


async def test_silently_stopped_etcd_is_detected_and_the_watch_reconnects(etcd: EtcdServer, writer: EtcdClient) -> None:
    settings = EtcdSettings(endpoints=(etcd.endpoint,), keepalive_time=5.0, keepalive_timeout=2.0, timeout=2.0)
    async with discovering(settings) as run:
        assert etcd.proc is not None
        etcd.proc.signal(signal.SIGSTOP)
        try:
            # Within dead_after (3 s) of the last answer, not the ~15 s gRPC keepalive pings would take.
            await eventually(lambda: not run.state.connected, settings.dead_after + 2.0, "silent partition detected")
            assert "UNAVAILABLE" in run.state.last_error or "timed out" in run.state.last_error
        finally:
            etcd.proc.signal(signal.SIGCONT)
        await eventually(lambda: run.state.connected and run.state.reconnects >= 1, 10.0, "reconnected")
        await writer.put(DECODE, b"")
        await eventually(lambda: DECODE in run.pool.nodes, 5.0, "event after the partition")
        assert run.state.resyncs == 0


async def test_watch_fails_over_to_another_member(cluster: EtcdCluster) -> None:
    settings = EtcdSettings(endpoints=cluster.endpoints, timeout=2.0)
    async with discovering(settings) as run, EtcdClient(settings) as writer:
        assert run.state.endpoint == cluster.endpoints[0]
        cluster.members[0].kill()
        await writer.put(DECODE, b"")
        await eventually(lambda: DECODE in run.pool.nodes, 10.0, "event through another member")
        assert run.state.endpoint != cluster.endpoints[0]
        assert run.state.reconnects >= 1
