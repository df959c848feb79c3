"""Whose turn it is: the timetable each background worker (load scrapes, model probes, ejected-node probes) takes
its next node from, at a capped rate whatever the number of nodes.

Each node has at most one due time, in one of three queues: urgent (nodes of models that get traffic and that
answer, nodes not yet usable), routine (other nodes that answer) and trial (new nodes, failing ones). The
first queue with a node due takes the turn, unless a later one with a node due has had less than its reserve
(``RESERVES``) of the recent turns. Turns are paced at ``rate`` a second, routine and trial ones together at no
more than ``routine_rate`` (each with up to one second's worth saved up while idle), so a worker's cost has a ceiling
however many nodes there are: beyond it, nodes wait longer for their turn, routine ones first. Taking a turn
is O(log n); a node the worker finds gone or idle gives its turn back.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time

URGENT, ROUTINE, TRIAL = 0, 1, 2
"""The queues, first to last: nodes in demand; the rest; nodes not known to answer (new, or failing)."""
RESERVES = (0.0, 0.2, 0.1)
"""The least share of the turns a queue gets while it has a node due, whatever the queues before it have."""


class Schedule:
    """Due times of keys (a pool's entry keys), taken in order by ``next()`` at no more than ``rate`` a second."""

    def __init__(self, rate: float, *, routine_rate: float | None = None) -> None:
        if rate <= 0 or (routine_rate is not None and routine_rate <= 0):
            raise ValueError("rates must be positive")
        self._gap = 1.0 / rate
        self._routine_gap = 1.0 / (routine_rate or rate)
        self._routine_allowed_at = 0.0
        self._queues: tuple[list[tuple[float, int, str]], ...] = ([], [], [])
        self._due: dict[str, tuple[float, int]] = {}
        self._order = itertools.count()
        self._allowed_at = 0.0
        self._taken = [0, 0, 0]
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

    def put(self, key: str, at: float, *, urgent: bool = False, trial: bool = False) -> None:
        """(Re)schedule ``key`` for ``at`` (``time.monotonic()``), replacing any earlier plan for it: in the urgent
        queue, else in the trial one (a node not known to answer), else in the routine one."""
        kind = URGENT if urgent else TRIAL if trial else ROUTINE
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
        if self._last_kind != URGENT:
            self._routine_allowed_at -= self._routine_gap

    def _head(self, kind: int) -> float | None:
        queue = self._queues[kind]
        while queue:
            at, _, key = queue[0]
            if self._due.get(key) == (at, kind):
                return at if kind == URGENT else max(at, self._routine_allowed_at)
            heapq.heappop(queue)  # replaced or dropped
        return None

    def _pick(self, now: float) -> tuple[float, int]:
        """When the next turn is due and from which queue (inf when all are empty)."""
        heads = [(at, kind) for kind in (URGENT, ROUTINE, TRIAL) if (at := self._head(kind)) is not None]
        due = [kind for at, kind in heads if at <= now]
        if not due:
            return min(heads, default=(math.inf, URGENT))
        total = sum(self._taken) + 1
        for kind in reversed(due[1:]):  # a later queue below its reserve goes first
            if self._taken[kind] < RESERVES[kind] * total:
                return now, kind
        return now, due[0]

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
                    if sum(self._taken) > 1000:  # the shares are judged on recent turns
                        self._taken = [n // 2 for n in self._taken]
                    self._allowed_at = max(self._allowed_at, now - 1.0) + self._gap
                    if kind != URGENT:
                        self._routine_allowed_at = max(self._routine_allowed_at, now - 1.0) + self._routine_gap
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
