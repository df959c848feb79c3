"""Drain, then sleep. The node is marked ``draining`` (no replica sends it new requests from the next watch event
on); once its own ``vllm:num_requests_running`` and ``_waiting`` are 0 (after ``DRAIN_SETTLE``, for requests
already on the wire) or after the drain timeout, it is put to sleep with vLLM's ``POST /sleep`` and marked
``asleep``. The sleep's ``mode`` is ``wait`` unless the operator gave one: a request still running at the timeout
finishes before the node sleeps, none is aborted. A wake that comes during the drain (the mark cleared by another
replica, or a wake racing the sleep) wins: the node stays, or is made, awake again.
"""

from __future__ import annotations

import asyncio
import logging
import time

from vllm_etcd_proxy.fleet.records import Sleep
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.sleep.calls import NodeAnswer, NodeCalls, Query, refused
from vllm_etcd_proxy.proxy.sleep.marks import MarkFailed, SleepMarks
from vllm_etcd_proxy.proxy.sleep.metrics import SleepMetrics

log = logging.getLogger(__name__)

DRAIN_SETTLE = 0.5
"""Seconds after the mark before an idle node counts as drained: requests a replica sent just before it saw the
mark are still on the wire."""
DRAIN_POLL = 0.25
"""Seconds between looks at the node's load while it drains."""


def model_of(state: NodeState) -> str:
    """A node's model label in metrics: its first served model."""
    return state.models[0] if state.models else ""


class Sleeper:
    def __init__(
        self, pool: Pool, calls: NodeCalls, marks: SleepMarks, metrics: SleepMetrics, *, drain_timeout: float
    ) -> None:
        self._pool, self._calls, self._marks, self._metrics = pool, calls, marks, metrics
        self._drain_timeout = drain_timeout

    async def sleep(self, state: NodeState, query: Query = (), *, reason: str) -> NodeAnswer:
        """Drain the node, then sleep it with ``query`` (vLLM's ``level``, ``mode``); its answer to ``/sleep``."""
        try:
            await self._marks.set(state, Sleep.DRAINING)
        except MarkFailed as exc:
            return self._done(state, reason, "failed", refused(state, str(exc)))
        await self._drain(state)
        if state.node.sleep is not Sleep.DRAINING:
            return self._done(state, reason, "woken", refused(state, "woken while it drained: it stays awake"))
        answer = await self._calls.post(state, "/sleep", _with_mode(query))
        if not answer.ok:
            await self._mark(state, Sleep.AWAKE, expect=Sleep.DRAINING)  # it serves again
            return self._done(state, reason, "failed", answer)
        self._pool.set_asleep(state, True)
        if not await self._mark(state, Sleep.ASLEEP, expect=Sleep.DRAINING):
            # A wake cleared the mark while the node fell asleep: whoever wanted it gets it back.
            log.info("woken while falling asleep node=%s: waking it again", state.node.node_id)
            if (await self._calls.post(state, "/wake_up")).ok:
                self._pool.set_asleep(state, False)
            return self._done(state, reason, "woken", answer)
        return self._done(state, reason, "ok", answer)

    async def _mark(self, state: NodeState, mark: Sleep, *, expect: Sleep) -> bool:
        try:
            return await self._marks.set(state, mark, expect=expect)
        except MarkFailed as exc:
            log.warning("sleep mark not written node=%s sleep=%s error=%s", state.node.node_id, mark.value, exc)
            return True  # the node's own /metrics tells every replica what it is

    async def _drain(self, state: NodeState) -> None:
        started = time.monotonic()
        settled, deadline = started + DRAIN_SETTLE, started + self._drain_timeout
        while state.node.sleep is Sleep.DRAINING:
            load = await self._calls.load(state)
            now = time.monotonic()
            if load == 0 and not state.in_flight and now >= settled:
                log.info("drained node=%s seconds=%.2f", state.node.node_id, now - started)
                return
            if now >= deadline:
                log.warning(
                    "drain timeout node=%s load=%s timeout=%gs: sleeping anyway",
                    state.node.node_id,
                    load,
                    self._drain_timeout,
                )
                return
            await asyncio.sleep(min(DRAIN_POLL, max(0.0, deadline - now)))

    def _done(self, state: NodeState, reason: str, outcome: str, answer: NodeAnswer) -> NodeAnswer:
        metrics = self._metrics
        metrics.child(metrics.sleeps, model_of(state), reason, outcome).inc()
        log.info(
            "node sleep node=%s reason=%s outcome=%s status=%s error=%s",
            state.node.node_id,
            reason,
            outcome,
            answer.status,
            answer.error or "-",
        )
        return answer


def _with_mode(query: Query) -> list[tuple[str, str]]:
    """The operator's query, with ``mode=wait`` unless it names a mode (vLLM's own default aborts)."""
    given = list(query)
    return given if any(name == "mode" for name, _ in given) else [*given, ("mode", "wait")]
