"""Each node's own load, scraped from its vLLM /metrics, for the load-aware policies.

A replica only knows its own in-flight requests; the node's ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` count every replica's and direct clients', and ``vllm:kv_cache_usage_perc`` says
how full its KV cache is. Every replica reads the same figures, so they judge a node's load alike. Scraped
every ``interval`` seconds (``--scrape-load``; a request per node per interval, read with a regular expression
rather than a full Prometheus parser: vLLM's page is large).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx

from proxy.pool import NodeState, Pool

log = logging.getLogger(__name__)

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
SCRAPE_TIMEOUT = httpx.Timeout(2.0)
PARALLEL_SCRAPES = 32
"""Scrapes in flight at once, however many nodes there are."""
_GAUGES = re.compile(
    rb"^vllm:(num_requests_running|num_requests_waiting|kv_cache_usage_perc)(?:\{[^}\n]*\})?[ \t]+(\S+)", re.M
)


def read_node_load(text: bytes) -> tuple[int, int, float] | None:
    """(running, waiting, KV-cache usage) from a vLLM /metrics page, summed over engines (usage: the highest);
    None when the page has none of them."""
    running = waiting = 0.0
    usage = 0.0
    seen = False
    for name, value in _GAUGES.findall(text):
        try:
            number = float(value)
        except ValueError:
            continue
        if number != number:  # NaN
            continue
        seen = True
        if name == b"num_requests_running":
            running += number
        elif name == b"num_requests_waiting":
            waiting += number
        else:
            usage = max(usage, number)
    return (int(running), int(waiting), usage) if seen else None




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
        state.node_running, state.node_waiting, state.kv_usage = parsed if parsed else (0, 0, 0.0)
