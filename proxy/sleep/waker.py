"""Wake one node: vLLM's ``POST /wake_up``; once it answers awake, the node's sleep mark is cleared (every
replica routes to it again from the next watch event) and this replica routes to it at once."""

from __future__ import annotations

import logging
import time

from vllm_etcd_proxy.fleet.records import Sleep
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.sleep.calls import NodeAnswer, NodeCalls, Query
from vllm_etcd_proxy.proxy.sleep.marks import MarkFailed, SleepMarks
from vllm_etcd_proxy.proxy.sleep.metrics import SleepMetrics
from vllm_etcd_proxy.proxy.sleep.sleeper import model_of

log = logging.getLogger(__name__)


def woke(answer: NodeAnswer) -> bool:
    """The node answered that it is awake (vLLM 0.32: ``{"status": "awake"}``; older vLLM: an empty 200)."""
    if not answer.ok:
        return False
    return not isinstance(answer.body, dict) or answer.body.get("status", "awake") == "awake"


class Waker:
    def __init__(self, pool: Pool, calls: NodeCalls, marks: SleepMarks, metrics: SleepMetrics) -> None:
        self._pool, self._calls, self._marks, self._metrics = pool, calls, marks, metrics

    async def wake(self, state: NodeState, query: Query = (), *, reason: str) -> NodeAnswer:
        """Wake the node (all of it, or vLLM's ``tags`` in ``query``); its answer to ``/wake_up``."""
        started = time.monotonic()
        answer = await self._calls.post(state, "/wake_up", query)
        seconds = time.monotonic() - started
        metrics, model = self._metrics, model_of(state)
        outcome = "ok" if woke(answer) else ("partial" if answer.ok else "failed")
        if outcome == "ok":
            self._pool.set_asleep(state, False)
            metrics.child(metrics.wake_seconds, model).observe(seconds)
            if state.node.sleep is not Sleep.AWAKE:
                try:
                    await self._marks.set(state, Sleep.AWAKE)
                except MarkFailed as exc:  # the node's own /metrics will say it is awake
                    log.warning("sleep mark not cleared node=%s error=%s", state.node.node_id, exc)
        metrics.child(metrics.wakes, model, reason, outcome).inc()
        log.info(
            "node wake node=%s reason=%s outcome=%s status=%s seconds=%.2f error=%s",
            state.node.node_id,
            reason,
            outcome,
            answer.status,
            seconds,
            answer.error or "-",
        )
        return answer
