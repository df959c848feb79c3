"""Whose turn it is: the timetable each background worker (load scrapes, model probes, ejected-node probes) takes
its next node from, at a capped rate whatever the number of nodes.

Each node has at most one due time, in one of two queues: urgent (nodes of models that get traffic, nodes not
yet usable) and routine (the rest). When both have a node due, routine gets ``reserve`` of the turns and urgent
the rest; when only one has, it gets them all. Turns are paced at ``rate`` a second, routine ones at no more
than ``routine_rate`` (each with up to one second's worth saved up while idle), so a worker's cost has a ceiling
however many nodes there are: beyond it, nodes wait longer for their turn, routine ones first. Taking a turn
is O(log n); a node the worker finds gone or idle gives its turn back.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time

URGENT, ROUTINE = 0, 1


class Schedule:
    """Due times of keys (a pool's entry keys), taken in order by ``next()`` at no more than ``rate`` a second."""

    def __init__(self, rate: float, *, routine_rate: float | None = None, reserve: float = 0.2) -> None:
        if rate <= 0 or (routine_rate is not None and routine_rate <= 0):
            raise ValueError("rates must be positive")
        self._gap = 1.0 / rate
        self._routine_gap = 1.0 / (routine_rate or rate)
        self._routine_allowed_at = 0.0
        self._reserve = reserve
        self._queues: tuple[list[tuple[float, int, str]], list[tuple[float, int, str]]] = ([], [])
        self._due: dict[str, tuple[float, int]] = {}
        self._order = itertools.count()
        self._allowed_at = 0.0
        self._taken = [0, 0]
        self._last_kind = URGENT
        self._lock = asyncio.Lock()
        self._wake: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, key: str) -> bool:
        return key in self._due

    def is_urgent(self, key: str) -> bool:
        found = self._due.get(key)
        return found is not None and found[1] == URGENT

    def due_at(self, key: str) -> float | None:
        found = self._due.get(key)
        return None if found is None else found[0]

    def put(self, key: str, at: float, *, urgent: bool = False) -> None:
        """(Re)schedule ``key`` for ``at`` (``time.monotonic()``), replacing any earlier plan for it."""
        kind = URGENT if urgent else ROUTINE
        self._due[key] = (at, kind)
        queue = self._queues[kind]
        heapq.heappush(queue, (at, next(self._order), key))
        if len(queue) > 2 * len(self._due) + 64:  # replaced plans pile up in the heap: sweep them out
            live = [e for e in queue if self._due.get(e[2]) == (e[0], kind)]
            heapq.heapify(live)
            self._queues[kind][:] = live
        if self._wake is not None:
            _resolve(self._wake)

    def drop(self, key: str) -> None:
        self._due.pop(key, None)

    def refund(self) -> None:
        """Give back the turn just taken (the worker found nothing to do for its key)."""
        self._allowed_at -= self._gap
        if self._last_kind == ROUTINE:
            self._routine_allowed_at -= self._routine_gap

    def _head(self, kind: int) -> tuple[float, str] | None:
        queue = self._queues[kind]
        while queue:
            at, _, key = queue[0]
            if self._due.get(key) == (at, kind):
                return at, key
            heapq.heappop(queue)  # replaced or dropped
        return None

    def _pick(self, now: float) -> tuple[float, int]:
        """When the next turn is due and from which queue (inf when both are empty)."""
        urgent, routine = self._head(URGENT), self._head(ROUTINE)
        if routine is not None:
            routine = max(routine[0], self._routine_allowed_at), routine[1]
        if urgent is not None and routine is not None and urgent[0] <= now and routine[0] <= now:
            taken = self._taken[URGENT] + self._taken[ROUTINE]
            return now, ROUTINE if self._taken[ROUTINE] < self._reserve * (taken + 1) else URGENT
        heads = [(h[0], kind) for kind, h in ((URGENT, urgent), (ROUTINE, routine)) if h is not None]
        return min(heads, default=(math.inf, URGENT))

    async def next(self) -> str:
        """The next key whose time has come, once the rate allows; waits as long as needed."""
        async with self._lock:
            while True:
                now = time.monotonic()
                at, kind = self._pick(now)
                at = max(at, self._allowed_at)
                if at <= now:
                    _, _, key = heapq.heappop(self._queues[kind])
                    del self._due[key]
                    self._taken[kind] += 1
                    self._last_kind = kind
                    if kind == ROUTINE:
                        self._routine_allowed_at = max(self._routine_allowed_at, now - 1.0) + self._routine_gap
                    if self._taken[URGENT] + self._taken[ROUTINE] > 1000:  # the share is judged on recent turns
                        self._taken = [n // 2 for n in self._taken]
                    self._allowed_at = max(self._allowed_at, now - 1.0) + self._gap
                    return key
                await self._sleep(at - now)

    async def _sleep(self, seconds: float) -> None:
        """Until ``seconds`` pass or a ``put`` may have made something due sooner."""
        loop = asyncio.get_running_loop()
        self._wake = wake = loop.create_future()
        timer = loop.call_later(seconds, _resolve, wake) if math.isfinite(seconds) else None
        try:
            await wake
        finally:
            if timer is not None:
                timer.cancel()
            self._wake = None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
