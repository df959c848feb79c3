"""LoRA adapters on one simulated node, as vLLM serves them (``--enable-lora``, ``--max-loras``).

- ``paths``: the adapters the node lists in /v1/models and accepts as a request's ``model`` (``--lora-modules``
  and ``POST /v1/load_lora_adapter``), name -> path; ``parents`` the base model of those that name one.
- The batch holds requests of at most ``max_loras`` adapters at once (vLLM's scheduler does not schedule a
  request whose adapter would be one more): a request for another adapter waits until one of them has no
  running request left. An adapter that was not among the last ``max_loras`` active ones is swapped in
  (``swaps`` counts them; ``--lora-swap-time`` is what it costs the request's first token).
- ``info_series``: vLLM's ``vllm:lora_requests_info`` gauge. Each distinct label set is a series that keeps the
  wall-clock time it was last the current one, so the page holds old series too and the latest value wins.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict, deque

HISTORY = 32
"""Series of ``vllm:lora_requests_info`` kept (vLLM keeps every one it ever set; a bound keeps the page small)."""


class Adapters:
    """The node's adapters and its adapter slots. ``enter``/``leave`` bracket a request's time in the batch."""

    def __init__(self, loras: tuple[tuple[str, str], ...], parents: dict[str, str], max_loras: int) -> None:
        self.paths: dict[str, str] = dict(loras)
        self.parents = dict(parents)
        self.max_loras = max_loras
        self.swaps = 0
        self._active: Counter[str] = Counter()
        """Admitted requests per adapter (running, or holding their adapter's place while they wait for a seat)."""
        self._resident: OrderedDict[str, None] = OrderedDict()
        """The adapters in the GPU slots, least recently activated first."""
        self._waiters: deque[tuple[str, asyncio.Future[bool]]] = deque()
        self._history: dict[tuple[str, str], float] = {}

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, name: str) -> bool:
        return name in self._active or len(self._active) < self.max_loras

    def _admit(self, name: str) -> bool:
        self._active[name] += 1
        swapped = name not in self._resident
        if swapped:
            self.swaps += 1
            self._resident[name] = None
            for old in list(self._resident):
                if len(self._resident) <= self.max_loras:
                    break
                if old not in self._active:
                    del self._resident[old]
        self._resident.move_to_end(name)
        return swapped

    async def enter(self, name: str) -> bool:
        """Wait for ``name`` to have a slot in the batch; True when it had to be swapped in."""
        if self._fits(name):  # as vLLM's scheduler, which skips a waiting request whose adapter does not fit
            return self._admit(name)
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append((name, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.leave(name)  # admitted in the instant we were cancelled
            else:
                self._waiters.remove((name, waiter))
            raise
        return waiter.result()

    def leave(self, name: str) -> None:
        self._active[name] -= 1
        if self._active[name] <= 0:
            del self._active[name]
        self._grant()

    def _grant(self) -> None:
        for entry in list(self._waiters):
            name, waiter = entry
            if waiter.done() or not self._fits(name):
                continue
            self._waiters.remove(entry)
            waiter.set_result(self._admit(name))

    def info_series(self) -> list[tuple[str, str, float]]:
        """(running, waiting, wall time last current) of every series, the current one stamped now."""
        waiting = ",".join(dict.fromkeys(n for n, _ in self._waiters))
        current = (",".join(self._active), waiting)
        self._history.pop(current, None)
        self._history[current] = time.time()
        while len(self._history) > HISTORY:
            del self._history[next(iter(self._history))]
        return [(running, queued, at) for (running, queued), at in self._history.items()]
