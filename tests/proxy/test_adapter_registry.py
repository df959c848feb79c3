"""Adapter keys in etcd reach every replica's registry through discovery; an invalid one is ignored, logged
and counted as an invalid record, and never disturbs the valid ones or the nodes."""

from __future__ import annotations

import asyncio
import contextlib

from tests.support.aio import eventually
from tests.support.etcd_server import EtcdServer
from vllm_etcd_proxy.fleet.adapters import FOLDER, adapter_key, adapter_value
from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdSettings
from vllm_etcd_proxy.fleet.records import KeyLayout
from vllm_etcd_proxy.proxy.discovery.adapters import AdapterRegistry
from vllm_etcd_proxy.proxy.discovery.events import DiscoveryState
from vllm_etcd_proxy.proxy.discovery.pool import Pool
from vllm_etcd_proxy.proxy.discovery.watch import Discovery

LAYOUT = KeyLayout()


async def test_adapters_are_listed_then_followed_and_invalid_ones_are_counted(etcd: EtcdServer) -> None:
    pool, state, registry = Pool(), DiscoveryState(), AdapterRegistry()
    async with EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,))) as writer:
        await writer.put(adapter_key(LAYOUT, "sql"), adapter_value("/loras/sql", "m"))
        await writer.put(adapter_key(LAYOUT, "bad"), b'{"path": "/x"}')
        discovery = Discovery(writer, LAYOUT, pool.apply_all, state, sinks={FOLDER: registry})
        task = asyncio.create_task(discovery.run())
        try:
            await eventually(lambda: state.synced and state.connected, 10.0, "discovery synced")
            assert [a.name for a in registry.all()] == ["sql"] and state.invalid_total == 1
            assert "non-empty path and base" in state.invalid_records[adapter_key(LAYOUT, "bad")]
            await writer.put(adapter_key(LAYOUT, "chat"), adapter_value("hub/chat", "m"))
            await writer.put(adapter_key(LAYOUT, "sql"), b"garbage")  # no longer a valid adapter: not loaded again
            await eventually(lambda: [a.name for a in registry.all()] == ["chat"], 5.0, "chat in, sql out")
            assert state.invalid_total == 2
            await writer.delete(adapter_key(LAYOUT, "chat"))
            await writer.put(adapter_key(LAYOUT, "bad"), adapter_value("/x", "m"))
            await eventually(lambda: [a.name for a in registry.all()] == ["bad"], 5.0, "chat gone, bad fixed")
            assert adapter_key(LAYOUT, "bad") not in state.invalid_records and pool.all() == []
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
