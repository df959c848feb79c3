"""Learns the models of nodes whose record names none (bare etcd keys, static and admin nodes).

A node is not routable until its GET /v1/models has answered once; after that it is re-asked every
``refresh`` seconds so a node that starts serving another model is picked up. A node that does not answer
is retried with a growing back-off, capped at ``refresh``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from vllm_etcd_proxy.fleet.vllm import ModelCard, parse_model_cards
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool

log = logging.getLogger(__name__)

PROBE_TIMEOUT = httpx.Timeout(5.0, connect=2.0)


async def fetch_models(
    client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None
) -> tuple[ModelCard, ...]:
    """The entries of ``{url}/v1/models``; raises httpx.HTTPError or ValueError on a bad answer."""
    response = await client.get(f"{url}/v1/models", timeout=PROBE_TIMEOUT, headers=headers)
    response.raise_for_status()
    return parse_model_cards(response.json())


class ModelProber:
    """Background task keeping learned models current."""

    def __init__(self, pool: Pool, client: httpx.AsyncClient, refresh: float, headers: dict[str, str] | None = None):
        self._pool = pool
        self._client = client
        self._refresh = refresh
        self._headers = headers
        self._due: dict[int, tuple[float, float]] = {}  # id(state) -> (next probe time, current back-off)
        self._wake = asyncio.Event()
        pool.on_change(self._wake.set)

    async def run(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            states = self._pool.needs_models()
            live = {id(s) for s in states}
            self._due = {k: v for k, v in self._due.items() if k in live}
            due = [s for s in states if self._due.get(id(s), (0.0, 0.0))[0] <= now]
            if due:
                await asyncio.gather(*(self._probe(s) for s in due))
            next_at = min((self._due[id(s)][0] for s in states if id(s) in self._due), default=now + self._refresh)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.05, next_at - time.monotonic()))
            except TimeoutError:
                pass

    async def _probe(self, state: NodeState) -> None:
        _, backoff = self._due.get(id(state), (0.0, 0.0))
        try:
            cards = await fetch_models(self._client, state.node.url, self._headers)
        except (httpx.HTTPError, ValueError) as exc:
            backoff = min(self._refresh, max(0.25, backoff * 2))
            self._due[id(state)] = (time.monotonic() + backoff, backoff)
            if not state.learned:
                log.info("node not answering /v1/models yet node=%s error=%s", state.node.node_id, type(exc).__name__)
            return
        self._due[id(state)] = (time.monotonic() + self._refresh, 0.0)
        models = tuple(card["id"] for card in cards)
        if not state.learned:
            log.info("learned models node=%s models=%s", state.node.node_id, ",".join(models))
        self._pool.set_learned_models(state, models, cards)
