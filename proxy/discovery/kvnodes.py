"""The replica's KV-event subscribers: one per pool entry whose node names a ``kv_events`` endpoint, started,
restarted (its endpoints changed) and stopped as the pool's nodes come and go (``Pool.on_node``/``on_drop``).
Each costs a task and two sockets; nothing here walks all nodes but ``start`` (once)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import zmq.asyncio

from vllm_etcd_proxy.proxy.discovery.kvreplay import REPLAY_TIMEOUT
from vllm_etcd_proxy.proxy.discovery.kvsub import KvSink, KvStats, Subscriber
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool

log = logging.getLogger(__name__)

STARTUP_GRACE = 2 * REPLAY_TIMEOUT
"""Seconds after start during which a publisher's first replay holds the replica's readiness (``catching_up``):
long enough for a node that answers, short enough that one that never does delays nothing for long."""


class KvSubscribers:
    """The subscribers of one replica, one per pool entry whose node names a ``kv_events`` endpoint."""

    def __init__(self, pool: Pool, sink: KvSink) -> None:
        self._pool, self._sink = pool, sink
        self.stats = KvStats()
        self._subs: dict[str, tuple[Subscriber, asyncio.Task[None]]] = {}
        self._context: zmq.asyncio.Context | None = None
        self._started_at: float | None = None
        pool.on_node(self._changed)
        pool.on_drop(self._dropped)

    def active(self) -> bool:
        """Whether some node's events are followed."""
        return bool(self._subs)

    def tracked(self, name: str) -> bool:
        found = self._subs.get(name)
        return found is not None and found[0].tracked

    def catching_up(self) -> int:
        """Publishers whose first replay is not applied yet, in the replica's first ``STARTUP_GRACE`` seconds (0
        after): a replica that takes traffic only after them routes its first requests on what the nodes hold.
        Nodes that join later never hold readiness back."""
        if self._started_at is None or time.monotonic() - self._started_at > STARTUP_GRACE:
            return 0
        return sum(not (sub.caught_up and sub.tracked) for sub, _ in self._subs.values())

    def view(self, name: str) -> dict[str, Any] | None:
        found = self._subs.get(name)
        return None if found is None else found[0].view()

    def start(self) -> None:
        """Subscribe to the nodes known now, and to those that come later (call in the running loop)."""
        self._context = zmq.asyncio.Context()
        self._started_at = time.monotonic()
        for state in self._pool.all():
            self._changed(state)

    async def stop(self) -> None:
        tasks = [task for _, task in self._subs.values()]
        for name in list(self._subs):
            self._stop(name)
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._context is not None:
            self._context.term()

    def _changed(self, state: NodeState) -> None:
        if self._context is None:
            return
        name, node = state.entry_key, state.node
        found = self._subs.get(name)
        if found is not None:
            if (found[0].endpoint, found[0].replay) == (node.kv_events, node.kv_events_replay):
                found[0].state = state
                return
            self._stop(name)
        if node.kv_events is None:
            return
        sub = Subscriber(name, state, node.kv_events, node.kv_events_replay, self._sink, self.stats)
        task = asyncio.get_running_loop().create_task(self._run(sub), name=f"kv-events {node.node_id}")
        self._subs[name] = (sub, task)

    async def _run(self, sub: Subscriber) -> None:
        assert self._context is not None
        while True:  # a bug in one subscriber must not end its node's tracking for good
            try:
                await sub.run(self._context)
            except Exception:
                log.exception("kv events subscriber failed node=%s", sub.name)
                sub.caught_up = True
            self._sink.drop(sub.name)
            sub.last_seq = None
            await asyncio.sleep(1.0)

    def _dropped(self, state: NodeState) -> None:
        found = self._subs.get(state.entry_key)
        if found is not None and found[0].state is state:
            self._stop(state.entry_key)

    def _stop(self, name: str) -> None:
        found = self._subs.pop(name, None)
        if found is not None:
            found[1].cancel()
            self._sink.drop(name)
