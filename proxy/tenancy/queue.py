"""Fair queueing while every node of a model is full: the request waits here, not in a node's queue.

A node is full when this replica has ``--max-connections`` requests open on it, or when its scraped waiting
queue holds ``--queue-when-waiting`` requests or more (counting, while the node was already queueing at its
last scrape, what this replica sent it since). A model is full when every candidate node of a role its
requests need is full. Its waiting requests are served most urgent priority first (lower number, as vLLM's
``priority``), and within a priority tenant by tenant in turn, a tenant with ``share=N`` getting N turns to a
share-1 tenant's one (stride scheduling). A turn is given when one of the model's requests ends, when a load
scrape of one of its nodes comes in, and, while something waits, every ``recheck`` seconds (for what changes
without an event: a node back from ejection or from a busy spell); no busy polling.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import Receive

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import QueueTimeout

RECHECK = 1.0
"""Seconds between looks at a model's nodes while requests wait: scrapes and request ends wake the queue, this only
catches what has no event."""


@dataclass(frozen=True, kw_only=True)
class QueueSettings:
    timeout: float
    """Longest wait in the queue before 503 (0: queueing off)."""
    max_connections: int
    when_waiting: int
    """A node whose scraped waiting queue holds this many is full (0: only --max-connections counts)."""
    recheck: float = RECHECK


@dataclass(eq=False)
class _Waiter:
    tenant: str
    turn: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _Level:
    """The waiting requests of one priority: a queue per tenant, served by stride (virtual time)."""

    def __init__(self) -> None:
        self.tenants: dict[str, deque[_Waiter]] = {}
        self.passes: dict[str, float] = {}
        self.clock = 0.0

    def push(self, waiter: _Waiter) -> None:
        line = self.tenants.setdefault(waiter.tenant, deque())
        if not line:  # a tenant that was idle starts level with the others, with no credit saved up
            self.passes[waiter.tenant] = max(self.passes.get(waiter.tenant, 0.0), self.clock)
        line.append(waiter)

    def pop(self, share: Callable[[str], int]) -> _Waiter | None:
        ready = [t for t, line in self.tenants.items() if line]
        if not ready:
            return None
        tenant = min(ready, key=lambda t: self.passes[t])
        self.clock = self.passes[tenant]
        self.passes[tenant] += 1.0 / share(tenant)
        return self.tenants[tenant].popleft()

    def remove(self, waiter: _Waiter) -> None:
        line = self.tenants.get(waiter.tenant)
        if line is not None and waiter in line:
            line.remove(waiter)

    def __len__(self) -> int:
        return sum(len(line) for line in self.tenants.values())


class _ModelQueue:
    def __init__(self) -> None:
        self.levels: dict[int, _Level] = {}
        self.depth = 0
        self.pending = 0
        """Requests given their turn that have not yet reached the forwarder (so room is not given twice)."""


class FairQueue:
    """The queues of one replica, by model. ``enter`` is called once per request; ``leave`` when it ends."""

    def __init__(
        self, pool: Pool, settings: QueueSettings, share: Callable[[str], int], on_depth: Callable[[str, int], None]
    ) -> None:
        self._pool = pool
        self._settings = settings
        self._share = share
        self._on_depth = on_depth
        self._models: dict[str, _ModelQueue] = {}
        self._seen: dict[str, tuple[float, int]] = {}
        """Per node: (time of the scrape this replica last saw, its in-flight count then)."""
        self._timer: asyncio.TimerHandle | None = None
        self._queued = 0
        pool.on_load(self._scraped)

    def depth(self, model: str) -> int:
        queue = self._models.get(model)
        return queue.depth if queue is not None else 0

    def _node_room(self, state: NodeState) -> float:
        room: float = self._settings.max_connections - state.in_flight
        threshold = self._settings.when_waiting
        if threshold and state.load_at is not None:
            key = state.entry_key
            seen = self._seen.get(key)
            if seen is None or seen[0] != state.load_at:
                seen = self._seen[key] = (state.load_at, state.in_flight)
            waiting = state.node_waiting
            if waiting:  # already queueing: what we sent since joined the queue
                waiting += max(0, state.in_flight - seen[1])
            room = min(room, threshold - waiting)
        return room

    def room(self, model: str) -> float:
        """How many more requests the model's nodes take now (inf when it has no candidates: not ours to hold)."""
        pool = self._pool
        prefill, decode = pool.candidates(Role.PREFILL, model), pool.candidates(Role.DECODE, model)
        if prefill and decode:
            groups = [prefill, decode]
        else:
            mixed = pool.candidates(Role.MIXED, model)
            groups = [mixed or decode]
        if not groups[0]:
            return math.inf
        return min(sum(max(0.0, self._node_room(s)) for s in nodes) for nodes in groups)

    async def enter(self, model: str, tenant: str, priority: int, receive: Receive) -> bool:
        """Wait for the model's turn; False when the client left meanwhile. Raises ``QueueTimeout``."""
        queue = self._models.get(model)
        if (queue is None or not queue.depth) and self.room(model) >= (queue.pending if queue else 0) + 1:
            return True  # room now, nobody ahead: never queued (a model no node serves ends here too)
        if queue is None:
            queue = self._models[model] = _ModelQueue()
        waiter = _Waiter(tenant)
        queue.levels.setdefault(priority, _Level()).push(waiter)
        self._depth(model, queue, +1)
        started = time.monotonic()
        self._dispatch(model)
        left = asyncio.ensure_future(receive())
        try:
            async with asyncio.timeout(self._settings.timeout):
                while not waiter.turn.done():
                    await asyncio.wait((waiter.turn, left), return_when=asyncio.FIRST_COMPLETED)
                    if left.done() and not waiter.turn.done():
                        if left.result().get("type") == "http.disconnect":
                            return False
                        left = asyncio.ensure_future(receive())
        except TimeoutError:
            raise QueueTimeout(
                f"every node of model {model!r} stayed full for {time.monotonic() - started:.0f}s; retry shortly",
                retry_after=max(1, math.ceil(self._settings.timeout / 2)),
            ) from None
        finally:
            left.cancel()
            if waiter.turn.done():
                queue.pending -= 1
            else:
                queue.levels[priority].remove(waiter)
                self._depth(model, queue, -1)
        return True

    def leave(self, model: str) -> None:
        """One of the model's requests ended (its node is released): give its room to the next in line."""
        if model in self._models and self._models[model].depth:
            self._dispatch(model)

    def _scraped(self, state: NodeState) -> None:
        """A node's load was scraped: it may have room for its models' waiting requests."""
        if self._queued:
            for model in state.models:
                if self.depth(model):
                    self._dispatch(model)

    def _depth(self, model: str, queue: _ModelQueue, change: int) -> None:
        queue.depth += change
        self._queued += change
        self._on_depth(model, change)
        if queue.depth and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._settings.recheck, self._recheck)

    def _recheck(self) -> None:
        self._timer = None
        for model, queue in list(self._models.items()):
            if queue.depth:
                self._dispatch(model)
        if any(q.depth for q in self._models.values()):
            self._timer = asyncio.get_running_loop().call_later(self._settings.recheck, self._recheck)

    def _dispatch(self, model: str) -> None:
        queue = self._models[model]
        room = self.room(model) - queue.pending
        while room >= 1 and queue.depth:
            waiter = None
            for priority in sorted(queue.levels):
                waiter = queue.levels[priority].pop(self._share)
                if waiter is not None:
                    break
            if waiter is None:
                break
            waiter.turn.set_result(None)
            queue.pending += 1
            self._depth(model, queue, -1)
            room -= 1
        for priority in [p for p, level in queue.levels.items() if not len(level)]:
            del queue.levels[priority]
