"""Each node's own load, scraped from its vLLM /metrics, for the load-aware policies.

A replica only knows its own in-flight requests; the node's ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` count every replica's and direct clients', and ``vllm:kv_cache_usage_perc`` says
how full its KV cache is. Every replica reads the same figures, so they judge a node's load alike. Scraped
every ``interval`` seconds (``--scrape-load``; a request per node per interval).
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from vllm_etcd_proxy.fleet.vllm import read_node_load
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT = httpx.Timeout(2.0)
PARALLEL_SCRAPES = 32
"""Scrapes in flight at once, however many nodes there are."""


class LoadWatcher:
    def __init__(self, pool: Pool, client: httpx.AsyncClient, interval: float, headers: dict[str, str] | None) -> None:
        self._pool = pool
        self._client = client
        self._interval = interval
        self._headers = headers

    async def run(self) -> None:
        limit = asyncio.Semaphore(PARALLEL_SCRAPES)
        while True:
            started = time.monotonic()
            states = [s for s in self._pool.all() if s.routable]
            await asyncio.gather(*(self._scrape(s, limit) for s in states))
            await asyncio.sleep(max(0.0, self._interval - (time.monotonic() - started)))

    async def _scrape(self, state: NodeState, limit: asyncio.Semaphore) -> None:
        async with limit:
            try:
                url = f"{state.node.url}/metrics"
                response = await self._client.get(url, timeout=SCRAPE_TIMEOUT, headers=self._headers)
                response.raise_for_status()
                parsed = read_node_load(response.content)
            except httpx.HTTPError as exc:
                log.debug("load scrape failed node=%s error=%s", state.node.node_id, type(exc).__name__)
                return
        self._pool.set_load(state, *(parsed or (0, 0, 0.0)))
