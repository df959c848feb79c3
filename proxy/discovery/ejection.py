"""Passive ejection: nodes that keep failing leave this replica's routing until a health probe succeeds.

Connect errors, timeouts, 5xx and broken streams count; 4xx, 429 and 503 ("busy") do not. A success is an
exchange that ended well, not a response's headers (a wedged engine still sends them). After
``after`` failures in a row the node is ejected and probed (GET /health) with a back-off that doubles with
each failed probe and each repeated ejection, up to ``max_backoff``. Ejection is per replica: replicas
share nothing, and each learns on its own within a few requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.discovery.schedule import Schedule

log = logging.getLogger(__name__)

PROBE_TIMEOUT = httpx.Timeout(2.0)
PROBE_RATE = 20.0
"""Health probes a second at most, however many nodes are ejected: the default of ``--eject-probe-rate``."""
PARALLEL_PROBES = 8
HEALTHY_SPELL = 30.0
"""Seconds a reinstated node must stay healthy before its ejection back-off starts again from the base."""


@dataclass(frozen=True, kw_only=True)
class EjectionSettings:
    """When to eject and how often to probe (``--eject-*``, whose definitions hold the defaults)."""

    after: int
    """Consecutive failures that eject a node; 0 disables ejection."""
    base_backoff: float
    """Seconds before the first probe of an ejected node."""
    max_backoff: float
    """Longest wait between probes."""
    probe_rate: float
    """Probes of ejected nodes a second at most, over all nodes."""


class Ejector:
    """Counts outcomes per node and runs the probes that bring ejected nodes back."""

    def __init__(self, pool: Pool, client: httpx.AsyncClient, settings: EjectionSettings) -> None:
        self._pool = pool
        self._client = client
        self._settings = settings
        self._schedule = Schedule(settings.probe_rate)
        self._reinstated_at: dict[int, float] = {}

    def success(self, state: NodeState) -> None:
        if state.failures or state.probation:
            self._pool.set_health(state, failures=0, probation=False)

    def failure(self, state: NodeState, reason: str) -> None:
        failures = state.failures + 1
        if state.ejected or not self._settings.after or failures < self._settings.after:
            self._pool.set_health(state, failures=failures, probation=state.probation)
            return
        now = time.monotonic()
        healthy_spell = now - self._reinstated_at.get(id(state), 0.0) > HEALTHY_SPELL
        ejections = 1 if healthy_spell else state.ejections + 1
        backoff = self._backoff(ejections)
        self._pool.set_health(
            state, failures=failures, probation=state.probation, ejections=ejections, probe_at=now + backoff
        )
        self._pool.set_ejected(state, True)
        self._schedule.put(state.entry_key, now + backoff, urgent=True)
        log.warning(
            "node ejected node=%s role=%s failures=%d reason=%s probe_in=%gs",
            state.node.node_id,
            state.node.role.value,
            state.failures,
            reason,
            backoff,
        )

    def _backoff(self, times: int) -> float:
        return float(min(self._settings.max_backoff, self._settings.base_backoff * 2 ** (times - 1)))

    async def run(self) -> None:
        """Probe ejected nodes when due, from ``PARALLEL_PROBES`` workers at ``rate`` probes a second at most."""
        for state in self._pool.ejected():
            self._schedule.put(state.entry_key, state.probe_at, urgent=True)
        async with asyncio.TaskGroup() as workers:  # one failing worker stops them all (a supervisor restarts)
            for _ in range(PARALLEL_PROBES):
                workers.create_task(self._work())

    async def _work(self) -> None:
        while True:
            key = await self._schedule.next()
            state = self._pool.get(key)
            if state is None or not state.ejected:
                self._schedule.refund()
                continue
            await self._probe(state)
            if state.ejected and self._pool.get(key) is state:
                self._schedule.put(key, state.probe_at, urgent=True)

    async def _probe(self, state: NodeState) -> None:
        try:
            response = await self._client.get(f"{state.node.url}/health", timeout=PROBE_TIMEOUT)
            healthy = response.status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy:
            # Probation: /health can be fine while requests hang, so the node gets one request at a time and
            # one more failure ejects it again.
            self._pool.set_health(state, failures=max(0, self._settings.after - 1), probation=True)
            self._reinstated_at[id(state)] = time.monotonic()
            self._pool.set_ejected(state, False)
            log.info("node reinstated node=%s role=%s", state.node.node_id, state.node.role.value)
            return
        ejections = state.ejections + 1
        self._pool.set_health(
            state,
            failures=state.failures,
            probation=state.probation,
            ejections=ejections,
            probe_at=time.monotonic() + self._backoff(ejections),
        )
