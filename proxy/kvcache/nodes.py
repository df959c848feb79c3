"""The replica's KV-event subscribers: one per pool entry whose node names a ``kv_events`` endpoint, started,
restarted (its endpoints changed) and stopped as the pool's nodes come and go (``Pool.on_node``/``on_drop``).
One thread reads them all (reader.py); nothing here walks all nodes but ``start`` (once)."""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.kvcache.reader import KvReader
from vllm_etcd_proxy.proxy.kvcache.replay import REPLAY_TIMEOUT
from vllm_etcd_proxy.proxy.kvcache.subscription import KvSink, KvStats, Subscriber

log = logging.getLogger(__name__)

STARTUP_GRACE = 2 * REPLAY_TIMEOUT
"""Seconds after start during which a publisher's first replay holds the replica's readiness (``catching_up``):
long enough for a node that answers, short enough that one that never does delays nothing for long."""


class KvSubscribers:
    """The subscribers of one replica, one per pool entry whose node names a ``kv_events`` endpoint."""

    def __init__(self, pool: Pool, sink: KvSink) -> None:
        self._pool, self._sink = pool, sink
        self.stats = KvStats()
        self._subs: dict[str, Subscriber] = {}
        self._reader: KvReader | None = None
        self._started_at: float | None = None
        pool.on_node(self._changed)
        pool.on_drop(self._dropped)

    def active(self) -> bool:
        """Whether some node's events are followed."""
        return bool(self._subs)

    def tracked(self, name: str) -> bool:
        found = self._subs.get(name)
        return found is not None and found.tracked

    def catching_up(self) -> int:
        """Publishers whose first replay is not applied yet, in the replica's first ``STARTUP_GRACE`` seconds (0
        after): a replica that takes traffic only after them routes its first requests on what the nodes hold.
        Nodes that join later never hold readiness back."""
        if self._started_at is None or time.monotonic() - self._started_at > STARTUP_GRACE:
            return 0
        return sum(not (sub.caught_up and sub.tracked) for sub in list(self._subs.values()))

    def view(self, name: str) -> dict[str, Any] | None:
        found = self._subs.get(name)
        return None if found is None else found.view()

    def start(self) -> None:
        """Subscribe to the nodes known now, and to those that come later (call in the running loop)."""
        self._reader = KvReader(self._sink, self.stats)
        self._reader.start()
        self._started_at = time.monotonic()
        for state in self._pool.all():
            self._changed(state)

    async def stop(self) -> None:
        for name in list(self._subs):
            self._stop(name)
        if self._reader is not None:
            await self._reader.stop()

    def _changed(self, state: NodeState) -> None:
        if self._reader is None:
            return
        name, node = state.entry_key, state.node
        found = self._subs.get(name)
        if found is not None:
            if (found.endpoint, found.replay) == (node.kv_events, node.kv_events_replay):
                found.state = state
                return
            self._stop(name)
        if node.kv_events is None:
            return
        sub = Subscriber(name, state, node.kv_events, node.kv_events_replay, self._sink, self.stats)
        self._subs[name] = sub
        self._reader.add(sub)

    def _dropped(self, state: NodeState) -> None:
        found = self._subs.get(state.entry_key)
        if found is not None and found.state is state:
            self._stop(state.entry_key)

    def _stop(self, name: str) -> None:
        found = self._subs.pop(name, None)
        if found is not None and self._reader is not None:
            self._reader.remove(found)  # its entries are dropped once its sockets are closed, in the reader
