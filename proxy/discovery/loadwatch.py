"""Each node's own load, scraped from its vLLM /metrics, for the load-aware policies.

A replica only knows its own in-flight requests; the node's ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` count every replica's and direct clients', and ``vllm:kv_cache_usage_perc`` says
how full its KV cache is. Every replica reads the same figures, so they judge a node's load alike. The same
goes for the node's speed: its mean time between output tokens over the last ``ITL_WINDOW`` seconds, from the
``vllm:inter_token_latency_seconds`` histogram's sum and count. Scraped every ``interval`` seconds
(``--scrape-load``; a request per node per interval) through the data path's own HTTP client, on connections
of its own: a replica spends about 0.26 ms of CPU per scrape, fetch and parse, against 1.34 ms through httpx
(``bench/scrape_cost.py``), which matters when it scrapes a hundred nodes twice a second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from vllm_etcd_proxy.fleet.vllm import read_asleep, read_node_load, read_token_latency
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import ProxyError, UpstreamFailed
from vllm_etcd_proxy.proxy.upstream.transport import Origin, Transport, UpstreamRequest

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT = 2.0
"""Seconds for a whole scrape; a node that takes longer keeps its last figures."""
PARALLEL_SCRAPES = 32
"""Scrapes in flight at once, however many nodes there are."""
ITL_WINDOW = 5.0
"""Seconds of the node's history its speed is judged on: long enough for hundreds of tokens, short enough for a
node that slows down to be seen within seconds."""
MIN_TOKENS = 50
"""Fewer inter-token gaps than this in the window say nothing: the last figure stays."""


class TokenLatency:
    """One node's mean inter-token latency over the last ``ITL_WINDOW`` seconds, from successive scrapes of
    its cumulative histogram."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float, float]] = deque()
        self.value: float | None = None

    def add(self, now: float, total: float, count: float) -> float | None:
        if self._samples and count < self._samples[-1][2]:
            self._samples.clear()  # the node restarted: its counters began again
        self._samples.append((now, total, count))
        while len(self._samples) > 2 and self._samples[1][0] <= now - ITL_WINDOW:
            self._samples.popleft()
        _, old_total, old_count = self._samples[0]
        if count - old_count >= MIN_TOKENS:
            self.value = (total - old_total) / (count - old_count)
        elif self.value is None and count >= MIN_TOKENS:
            self.value = total / count  # first sight of a node that already served: its whole history
        return self.value


class LoadWatcher:
    def __init__(self, pool: Pool, transport: Transport, interval: float, headers: dict[str, str] | None) -> None:
        self._pool = pool
        self._transport = transport
        self._interval = interval
        self._head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode("latin-1")
        self._latency: dict[str, TokenLatency] = {}

    async def run(self) -> None:
        limit = asyncio.Semaphore(PARALLEL_SCRAPES)
        while True:
            started = time.monotonic()
            states = [s for s in self._pool.all() if s.routable]
            if len(self._latency) > 2 * len(states) + 100:  # nodes come and go
                keep = {s.entry_key for s in states}
                self._latency = {k: v for k, v in self._latency.items() if k in keep}
            await asyncio.gather(*(self._scrape(s, limit) for s in states))
            await asyncio.sleep(max(0.0, self._interval - (time.monotonic() - started)))

    async def _fetch(self, url: str) -> bytes:
        """The body of ``url``'s /metrics; raises ProxyError (or TimeoutError) when the node does not give it."""
        request = UpstreamRequest(origin=Origin.of(url), path=b"/metrics", head=self._head, body=b"",
                                  timeout=SCRAPE_TIMEOUT, idle_timeout=SCRAPE_TIMEOUT, method=b"GET")  # fmt: skip
        async with asyncio.timeout(SCRAPE_TIMEOUT):
            response = await self._transport.send(request)
            try:
                if response.status != 200:
                    raise UpstreamFailed(f"/metrics answered {response.status}")
                chunks = []
                while chunk := await response.read():
                    chunks.append(chunk)
                return b"".join(chunks)
            finally:
                response.close()

    async def _scrape(self, state: NodeState, limit: asyncio.Semaphore) -> None:
        async with limit:
            try:
                page = await self._fetch(state.node.url)
            except (ProxyError, TimeoutError) as exc:
                log.debug("load scrape failed node=%s error=%s", state.node.node_id, exc)
                return
            parsed = read_node_load(page)
            latency = read_token_latency(page)
            asleep = read_asleep(page)
        now = time.monotonic()
        self._pool.set_asleep(state, bool(asleep))
        self._pool.set_load(state, *(parsed or (0, 0, 0.0)), at=now)
        if latency is not None:
            tracker = self._latency.setdefault(state.entry_key, TokenLatency())
            self._pool.set_token_latency(state, tracker.add(now, *latency))
