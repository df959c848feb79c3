"""Keys under the cluster prefix that are not nodes (``adapters/``, ``keys/``, ...) go to their folder's sink."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping, Sequence

from tests.support.aio import eventually
from tests.support.etcd_server import EtcdServer
from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdSettings
from vllm_etcd_proxy.fleet.records import KeyLayout, Role
from vllm_etcd_proxy.proxy.discovery.events import DiscoveryState, PoolEvent
from vllm_etcd_proxy.proxy.discovery.pool import Pool
from vllm_etcd_proxy.proxy.discovery.watch import Discovery

LAYOUT = KeyLayout()
FOLDER = f"{LAYOUT.cluster_prefix}adapters/"


class Folder:
    """A sink that keeps valid JSON objects and refuses anything else."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, object]] = {}
        self.replaced = 0

    def _load(self, value: bytes) -> dict[str, object] | str:
        try:
            obj = json.loads(value)
        except ValueError:
            return "not JSON"
        return obj if isinstance(obj, dict) else "not an object"

    def replace(self, entries: Mapping[str, bytes]) -> Mapping[str, str]:
        self.replaced += 1
        self.entries, invalid = {}, {}
        for name, value in entries.items():
            loaded = self._load(value)
            if isinstance(loaded, str):
                invalid[name] = loaded
            else:
                self.entries[name] = loaded
        return invalid

    def put(self, name: str, value: bytes) -> str | None:
        loaded = self._load(value)
        if isinstance(loaded, str):
            self.entries.pop(name, None)
            return loaded
        self.entries[name] = loaded
        return None

    def delete(self, name: str) -> None:
        self.entries.pop(name, None)


async def test_folder_keys_reach_their_sink_and_never_the_pool(etcd: EtcdServer) -> None:
    pool, state, folder = Pool(), DiscoveryState(), Folder()
    applied: list[PoolEvent] = []

    def apply(events: Sequence[PoolEvent]) -> None:
        applied.extend(events)
        pool.apply_all(events)

    node_key = LAYOUT.key(Role.MIXED, "127.0.0.1:8300")
    async with EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,))) as writer:
        await writer.put(FOLDER + "listed", b'{"path": "/a", "base": "m"}')
        await writer.put(FOLDER + "broken", b"{")
        await writer.put(node_key, json.dumps({"url": "http://127.0.0.1:8300", "models": ["m"]}))
        await writer.put(f"{LAYOUT.cluster_prefix}unknown/x", b"{}")  # no sink: invalid, as before
        discovery = Discovery(writer, LAYOUT, apply, state, sinks={"adapters": folder})
        task = asyncio.create_task(discovery.run())
        try:
            await eventually(lambda: state.synced and state.connected, 10.0, "discovery synced")
            assert folder.entries == {"listed": {"path": "/a", "base": "m"}} and folder.replaced == 1
            assert set(state.invalid_records) == {FOLDER + "broken", f"{LAYOUT.cluster_prefix}unknown/x"}
            assert [s.node.node_id for s in pool.all()] == ["127.0.0.1:8300"]

            await writer.put(FOLDER + "watched", b'{"path": "/b"}')
            await writer.put(FOLDER + "broken", b'{"path": "/c"}')  # repaired: no longer invalid
            await writer.delete(FOLDER + "listed")
            await eventually(lambda: set(folder.entries) == {"watched", "broken"}, 5.0, "folder watched")
            await eventually(lambda: FOLDER + "broken" not in state.invalid_records, 5.0, "repair seen")
            invalid_before = state.invalid_total
            await writer.put(FOLDER + "watched", b"[1]")
            await eventually(lambda: FOLDER + "watched" in state.invalid_records, 5.0, "bad put seen")
            assert state.invalid_total == invalid_before + 1 and "watched" not in folder.entries
            assert [s.node.node_id for s in pool.all()] == ["127.0.0.1:8300"]
            assert not any(FOLDER in repr(e) for e in applied)  # the pool never heard of them
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
