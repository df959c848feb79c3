"""Sleep after idle (``--sleep-after-idle [MODEL=]S``, or the label ``sleep-after-idle: S`` on a node's record): a
node whose model has had no request for S seconds anywhere in the fleet is drained and put to sleep
(``--sleep-level``), keeping at least ``--min-awake`` nodes of each model awake.

"Anywhere in the fleet" is read from the nodes themselves: a node is active while its own /metrics show requests
running or waiting or its finished-request counter moves (every replica's requests, and direct clients'), and
this replica adds its own requests for the model. Every replica sees the same figures, so they agree within a
scrape; the one that takes the ``idle/{model}`` claim puts the surplus nodes to sleep, one model at a time, and
counts the model's awake nodes again under the claim, so ``--min-awake`` holds however many replicas look.
A replica counts a node idle only from when it first saw it: a replica that starts sleeps nothing for S seconds.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Mapping

from vllm_etcd_proxy.proxy.discovery.claims import Claims
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.sleep.sleeper import Sleeper, model_of

log = logging.getLogger(__name__)

LABEL = "sleep-after-idle"
"""A node's record label that sets its idle time in seconds (over the flag)."""
CHECK_EVERY = 1.0
"""Seconds between looks at the nodes' idle times."""


class IdleSleeper:
    def __init__(
        self,
        pool: Pool,
        sleeper: Sleeper,
        claims: Claims,
        *,
        after: Mapping[str, float],
        min_awake: int,
        level: int,
    ) -> None:
        self._pool, self._sleeper, self._claims = pool, sleeper, claims
        self._after = dict(after)
        """Idle seconds by model; ``""``: every other model."""
        self._min_awake = min_awake
        self._level = level
        self._busy: dict[str, asyncio.Task[None]] = {}
        self._bad_labels: set[str] = set()

    def idle_after(self, state: NodeState) -> float | None:
        """Seconds of idleness after which the node may sleep (None: never)."""
        label = state.node.labels.get(LABEL)
        if label is not None:
            try:
                seconds = float(label)
                if seconds > 0 and math.isfinite(seconds):
                    return seconds
            except ValueError:
                pass
            if state.entry_key not in self._bad_labels:
                self._bad_labels.add(state.entry_key)
                log.warning("ignored label node=%s %s=%r: not a number of seconds", state.node.node_id, LABEL, label)
        for model in state.models:
            if model in self._after:
                return self._after[model]
        return self._after.get("")

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(CHECK_EVERY)
                self.check()
        finally:
            for task in list(self._busy.values()):
                task.cancel()

    def check(self) -> None:
        """Start putting the surplus idle nodes of each model to sleep (a task per model, one at a time)."""
        for model, nodes in self._awake_by_model().items():
            if model in self._busy or len(nodes) <= self._min_awake:
                continue
            idle = [s for s in nodes if self._idle(model, s)]
            if idle:
                task = self._busy[model] = asyncio.create_task(self._sleep_some(model, idle), name=f"idle {model}")
                task.add_done_callback(functools.partial(self._ended, model))

    def _awake_by_model(self) -> dict[str, list[NodeState]]:
        models: dict[str, list[NodeState]] = {}
        for state in self._pool.routable():
            if not state.asleep and state.models:
                models.setdefault(model_of(state), []).append(state)
        return models

    def _idle(self, model: str, state: NodeState) -> bool:
        after = self.idle_after(state)
        if after is None or state.in_flight:
            return False
        last = max(state.active_at, self._pool.last_asked(model) or -math.inf)
        return time.monotonic() - last >= after

    async def _sleep_some(self, model: str, idle: list[NodeState]) -> None:
        claim = await self._claims.take(f"idle/{model}")
        if claim is None:
            return  # another replica is at it
        try:
            awake = self._awake_by_model().get(model, [])
            surplus = len(awake) - self._min_awake
            for state in [s for s in idle if s in awake][: max(0, surplus)]:
                if self._idle(model, state):  # still, under the claim
                    log.info("idle node model=%s node=%s: putting it to sleep", model, state.node.node_id)
                    await self._sleeper.sleep(state, [("level", str(self._level))], reason="idle")
        finally:
            await claim.release()

    def _ended(self, model: str, task: asyncio.Task[None]) -> None:
        self._busy.pop(model, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("idle sleep of model=%s failed", model, exc_info=task.exception())
