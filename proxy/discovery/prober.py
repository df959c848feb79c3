"""Learns the models of nodes whose record names none (bare etcd keys, static and admin nodes).

A node is not routable until its GET /v1/models has answered once; after that it is re-asked every
``refresh`` seconds so a node that starts serving another model is picked up. A node that does not answer
is retried with a growing back-off, capped at ``refresh``. All of it within a total rate (``PROBE_RATE``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from vllm_etcd_proxy.fleet.vllm import ModelCard, parse_model_cards
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.discovery.schedule import Schedule

log = logging.getLogger(__name__)

PROBE_TIMEOUT = httpx.Timeout(5.0, connect=2.0)
PROBE_RATE = 20.0
"""Probes a second at most, however many nodes there are (about 1 ms of CPU each through httpx)."""
ROUTINE_PROBE_RATE = 10.0
"""Of which at most this many for refreshes, and for new nodes that did not answer their first few probes (with
``--models-probe-rate``, the same share of it)."""
EAGER_BACKOFF = 0.25
"""A new node is probed first (urgent) while its back-off is this short: its first 2 probes, 0.25 s apart; then
it waits its back-off among the routine turns (a bare key written before its node is up)."""
PARALLEL_PROBES = 8


async def fetch_models(
    client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None
) -> tuple[ModelCard, ...]:
    """The entries of ``{url}/v1/models``; raises httpx.HTTPError or ValueError on a bad answer."""
    response = await client.get(f"{url}/v1/models", timeout=PROBE_TIMEOUT, headers=headers)
    response.raise_for_status()
    return parse_model_cards(response.json())


class ModelProber:
    """Background workers keeping learned models current, at most ``rate`` probes a second in all: nodes not yet
    routable first, while they answer or are new (see ``Schedule``)."""

    def __init__(
        self,
        pool: Pool,
        client: httpx.AsyncClient,
        refresh: float,
        headers: dict[str, str] | None = None,
        *,
        rate: float = PROBE_RATE,
    ) -> None:
        self._pool = pool
        self._client = client
        self._refresh = refresh
        self._headers = headers
        self._backoff: dict[str, float] = {}
        self._schedule = Schedule(rate, routine_rate=rate * ROUTINE_PROBE_RATE / PROBE_RATE)
        pool.on_node(self._noticed)

    def _noticed(self, state: NodeState) -> None:
        key = state.entry_key
        if not state.node.models and key not in self._schedule:
            self._schedule.put(key, time.monotonic(), urgent=not state.learned)

    async def run(self) -> None:
        for state in self._pool.all():  # nodes that came before this task started
            self._noticed(state)
        async with asyncio.TaskGroup() as workers:  # one failing worker stops them all (a supervisor restarts)
            for _ in range(PARALLEL_PROBES):
                workers.create_task(self._work())

    async def _work(self) -> None:
        while True:
            key = await self._schedule.next()
            state = self._pool.get(key)
            if state is None or state.node.models:  # gone, or its record names its models now
                self._schedule.refund()
                self._backoff.pop(key, None)
                continue
            answered = await self._probe(state)
            if self._pool.get(key) is not state:
                continue  # replaced meanwhile: the new node was scheduled when it came
            if answered:
                self._backoff.pop(key, None)
                self._schedule.put(key, time.monotonic() + self._refresh)
            else:
                backoff = self._backoff[key] = min(self._refresh, max(0.25, 2 * self._backoff.get(key, 0.0)))
                urgent = not state.learned and backoff <= EAGER_BACKOFF
                self._schedule.put(key, time.monotonic() + backoff, urgent=urgent, trial=not urgent)

    async def _probe(self, state: NodeState) -> bool:
        try:
            cards = await fetch_models(self._client, state.node.url, self._headers)
        except (httpx.HTTPError, ValueError) as exc:
            if not state.learned:
                log.info("node not answering /v1/models yet node=%s error=%s", state.node.node_id, type(exc).__name__)
            return False
        models = tuple(card["id"] for card in cards)
        if not state.learned:
            log.info("learned models node=%s models=%s", state.node.node_id, ",".join(models))
        self._pool.set_learned_models(state, models, cards)
        return True
