"""Optional: each node's own queue, scraped from its vLLM /metrics, for the load-aware policies.

A replica only knows its own in-flight requests; the node's ``vllm:num_requests_waiting`` also counts the
other replicas' and direct clients'. Scraped every ``interval`` seconds (off by default: it costs a request
per node per interval).
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy.pool import NodeState, Pool

log = logging.getLogger(__name__)

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
SCRAPE_TIMEOUT = httpx.Timeout(2.0)


def parse_vllm_load(text: str) -> tuple[float, float] | None:
    """(running, waiting) summed over label sets (engines, models); None when neither gauge is there.

    Raises ValueError when ``text`` is not Prometheus text.
    """
    running = waiting = 0.0
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == RUNNING:
                running, seen = running + sample.value, True
            elif sample.name == WAITING:
                waiting, seen = waiting + sample.value, True
    return (running, waiting) if seen else None


class LoadWatcher:
    def __init__(self, pool: Pool, client: httpx.AsyncClient, interval: float, headers: dict[str, str] | None) -> None:
        self._pool = pool
        self._client = client
        self._interval = interval
        self._headers = headers

    async def run(self) -> None:
        while True:
            states = [s for s in self._pool.all() if s.routable]
            await asyncio.gather(*(self._scrape(s) for s in states))
            await asyncio.sleep(self._interval)

    async def _scrape(self, state: NodeState) -> None:
        try:
            url = f"{state.node.url}/metrics"
            response = await self._client.get(url, timeout=SCRAPE_TIMEOUT, headers=self._headers)
            response.raise_for_status()
            parsed = parse_vllm_load(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("load scrape failed node=%s error=%s", state.node.node_id, type(exc).__name__)
            return
        state.node_waiting = int(parsed[1]) if parsed else 0
