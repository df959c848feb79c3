"""vLLM 0.32's sleep mode on one node: the paused scheduler, the executor's sleeping memory tags, the gauge.

What vLLM does (vllm/v1/engine/core.py ``sleep``/``wake_up``, v1/executor/abstract.py, v1/metrics/loggers.py):

- ``sleep(level, mode)`` pauses the scheduler first: requests that arrive are accepted but not processed; ``mode``
  says what happens to those already in the engine (``abort`` ends them, ``wait`` lets them finish before the
  sleep completes, ``keep`` freezes them until the wake). Level 0 stops there (no memory changes); level 1
  offloads the weights to CPU memory and discards the KV cache, level 2 discards both: the executor then sleeps
  with the tags ``weights`` and ``kv_cache``, and the prefix cache is cleared.
- ``wake_up(tags)`` wakes the executor's tags (all of them without tags; a tag that is not sleeping changes
  nothing); ``scheduling`` is not a memory tag. Only once no tag sleeps does the scheduler resume: a partial
  wake answers "sleeping".
- ``vllm:engine_sleep_state{sleep_state}``: after a sleep of any level ``awake`` is 0, ``weights_offloaded`` 1 at
  level 1, ``discard_all`` 1 at level 2; after a full wake ``awake`` 1 and the others 0.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from vllm_etcd_proxy.sim.gpu import Gpu

log = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")
"""The executor's memory tags, as vLLM's ``SLEEP_TAGS``."""
SCHEDULING = "scheduling"
"""The tag that wakes a level-0 sleep (vLLM: ``tags=["scheduling"]``); it holds no memory."""


class SleepMode:
    """One node's sleep state and the GPU memory it holds (``gpu``); the engine pauses and resumes through it."""

    def __init__(self, gpu: Gpu, sizes: Mapping[str, int]) -> None:
        self._gpu = gpu
        self._sizes = {tag: sizes.get(tag, 0) for tag in TAGS}
        self.paused = False
        """The scheduler is paused: new generations hold until the wake."""
        self.keeps = False
        """Paused with ``mode=keep``: generations already running hold too."""
        self.sleeping: set[str] = set()
        """The executor's memory tags that sleep (offloaded or discarded)."""
        self._gauge = {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
        self._awake = asyncio.Event()
        self._awake.set()
        gpu.hold(self.memory)  # the node's start: out of memory is fatal, as for vLLM

    @property
    def memory(self) -> int:
        """Bytes held on the GPU now."""
        return sum(size for tag, size in self._sizes.items() if tag not in self.sleeping)

    @property
    def is_sleeping(self) -> bool:
        """vLLM's ``is_sleeping``: the scheduler is paused or some memory sleeps."""
        return self.paused or bool(self.sleeping)

    def gauge(self) -> Mapping[str, float]:
        """``vllm:engine_sleep_state`` by ``sleep_state``."""
        return self._gauge

    def pause(self, mode: str) -> None:
        self.paused, self.keeps = True, mode == "keep"
        self._awake.clear()

    def offload(self, level: int) -> None:
        """The executor's part of a sleep of ``level`` (after the pause); the gauge says the new state."""
        if level >= 1 and "weights" not in self.sleeping:
            self.sleeping |= set(TAGS)
            self._gpu.hold(self.memory)
        self._gauge = {"awake": 0.0, "weights_offloaded": float(level == 1), "discard_all": float(level == 2)}

    def wake(self, tags: list[str] | None) -> bool:
        """Wake ``tags`` (None: all); True when fully awake (the scheduler resumed). Raises ``OutOfMemory``."""
        if tags is not None and SCHEDULING in tags:
            tags = [t for t in tags if t != SCHEDULING]
        if tags is None or tags:
            self._wake_memory(tags)
        if self.sleeping:
            return False
        self.paused = self.keeps = False
        self._gauge = {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
        self._awake.set()
        return True

    def waking(self, tags: list[str] | None) -> bool:
        """Whether a wake with ``tags`` would bring some memory back (which takes the node's wake time)."""
        if tags is None:
            return bool(self.sleeping)
        return bool(set(tags) & self.sleeping) and set(tags) - {SCHEDULING} <= self.sleeping

    def _wake_memory(self, tags: list[str] | None) -> None:
        if not self.sleeping:
            return  # vLLM: "Executor is not sleeping."
        if tags and any(t not in self.sleeping for t in tags):
            log.warning("tag not sleeping tags=%s sleeping=%s", ",".join(tags), ",".join(sorted(self.sleeping)))
            return
        waking = set(tags) if tags else set(self.sleeping)
        self._gpu.hold(self.memory + sum(self._sizes[t] for t in waking))
        self.sleeping -= waking

    async def until_awake(self) -> bool:
        """Wait while the scheduler is paused; True when it had to wait."""
        if self._awake.is_set():
            return False
        await self._awake.wait()
        return True
