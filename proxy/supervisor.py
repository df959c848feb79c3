"""A replica's background loops (probes, load scrapes, etcd discovery, ...), supervised: a loop that fails is
logged at once with its traceback, counted (``vllm_proxy_background_task_crashes_total{task}``) and started again
after a back-off, so a bug never leaves the fleet's health or load figures frozen without a word."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import Counter

log = logging.getLogger(__name__)

FIRST_DELAY = 0.5
"""Seconds before a failed loop runs again; doubled after each failure that follows soon, up to ``MAX_DELAY``."""
MAX_DELAY = 30.0
HEALTHY_AFTER = 60.0
"""Seconds a loop must have run before its failure counts as a first one again."""


class Supervisor:
    """Runs each loop in its own task until ``stop``; see the module docstring."""

    def __init__(self, crashes: Counter) -> None:
        self._crashes = crashes
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run ``loop()`` (meant to run forever) in a task named ``name``, restarting it when it fails or ends."""
        self._tasks.append(asyncio.create_task(self._guard(name, loop), name=name))

    async def _guard(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        clock = asyncio.get_running_loop()
        delay = FIRST_DELAY
        while True:
            began = clock.time()
            try:
                await loop()
                failure = None
            except Exception as exc:
                failure = exc
            if clock.time() - began >= HEALTHY_AFTER:
                delay = FIRST_DELAY
            self._crashes.labels(name).inc()
            if failure is None:
                log.error("background task ended on its own task=%s; starting it again in %.1fs", name, delay)
            else:
                log.error("background task failed task=%s; starting it again in %.1fs", name, delay, exc_info=failure)
            await asyncio.sleep(delay)
            delay = min(MAX_DELAY, 2 * delay)

    async def stop(self) -> None:
        """Cancel every loop and wait for them to end."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
