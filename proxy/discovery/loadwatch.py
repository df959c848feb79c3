"""Each node's own load, scraped from its vLLM /metrics, for the load-aware policies.

A replica only knows its own in-flight requests; the node's ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` count every replica's and direct clients', and ``vllm:kv_cache_usage_perc`` says
how full its KV cache is. Every replica reads the same figures, so they judge a node's load alike. The same
goes for the node's speed: its mean time between output tokens over the last ``ITL_WINDOW`` seconds, from the
``vllm:inter_token_latency_seconds`` histogram's sum and count, and for its prefix cache's hit rate over the same
window (``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``), which the replica only
re-exports (``vllm_proxy_node_prefix_cache_hit_rate``). Scraped every ``interval`` seconds
(``--scrape-load``; a request per node per interval, within a total rate) through the data path's own HTTP
client, on connections of its own: a replica spends about 0.26 ms of CPU per scrape, fetch and parse, against
1.34 ms through httpx (``bench/scrape_cost.py``), which matters when it scrapes a hundred nodes twice a second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from vllm_etcd_proxy.fleet.vllm import (
    read_asleep,
    read_finished,
    read_lora_info,
    read_node_load,
    read_prefix_cache,
    read_token_latency,
)
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.discovery.schedule import Schedule
from vllm_etcd_proxy.proxy.errors import ProxyError, UpstreamFailed
from vllm_etcd_proxy.proxy.upstream.transport import Origin, Transport, UpstreamRequest

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT = 2.0
"""Seconds for a whole scrape; a node that takes longer keeps its last figures."""
PARALLEL_SCRAPES = 32
"""Scrapes in flight at once, however many nodes there are."""
SCRAPE_RATE = 250.0
"""Scrapes a second at most, however many nodes there are: about 6% of a core (0.26 ms each), and every node
twice a second up to 100 nodes of models in demand; beyond that their figures age in proportion (README, "Scale")."""
ROUTINE_SCRAPE_RATE = 50.0
"""Of which at most this many for nodes no request asked for lately, new ones, and those whose last scrape
failed (these last, see ``Schedule``); with ``--scrape-rate``, the same share of it."""
MAX_BACKOFF = 30.0
"""Longest wait before asking again a node whose scrape failed (refused, timed out, not 200)."""
ITL_WINDOW = 5.0
"""Seconds of the node's history its speed is judged on: long enough for hundreds of tokens, short enough for a
node that slows down to be seen within seconds."""
MIN_TOKENS = 50
"""Fewer inter-token gaps than this in the window say nothing: the last figure stays."""


class TokenLatency:
    """One node's mean inter-token latency over the last ``ITL_WINDOW`` seconds, from successive scrapes of
    its cumulative histogram; alike, any ratio of two of its counters over that window (the prefix cache's hits
    per query) with ``minimum`` the least growth of the divisor that says something."""

    def __init__(self, minimum: float = MIN_TOKENS) -> None:
        self._samples: deque[tuple[float, float, float]] = deque()
        self.value: float | None = None
        self._minimum = minimum

    def add(self, now: float, total: float, count: float) -> float | None:
        if self._samples and count < self._samples[-1][2]:
            self._samples.clear()  # the node restarted: its counters began again
        self._samples.append((now, total, count))
        while len(self._samples) > 2 and self._samples[1][0] <= now - ITL_WINDOW:
            self._samples.popleft()
        _, old_total, old_count = self._samples[0]
        if count - old_count >= self._minimum:
            self.value = (total - old_total) / (count - old_count)
        elif self.value is None and count >= self._minimum:
            self.value = total / count  # first sight of a node that already served: its whole history
        return self.value


class LoadWatcher:
    """Scrapes routable nodes' /metrics from ``PARALLEL_SCRAPES`` long-lived workers, each node every
    ``interval`` seconds, at most ``rate`` scrapes a second in all (see ``Schedule``): nodes of models in demand
    first. A node that does not answer is asked again after a back-off that doubles up to ``MAX_BACKOFF``, at the
    routine rate, until it answers."""

    def __init__(
        self,
        pool: Pool,
        transport: Transport,
        interval: float,
        headers: dict[str, str] | None,
        *,
        rate: float = SCRAPE_RATE,
    ) -> None:
        self._pool = pool
        self._transport = transport
        self._interval = interval
        self._head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode("latin-1")
        self._latency: dict[str, TokenLatency] = {}
        self._hit_rates: dict[str, TokenLatency] = {}
        self._backoff: dict[str, float] = {}
        self._schedule = Schedule(rate, routine_rate=rate * ROUTINE_SCRAPE_RATE / SCRAPE_RATE)
        pool.on_node(self._noticed)
        pool.on_demand(self._demanded)

    def _noticed(self, state: NodeState) -> None:
        key = state.entry_key
        if state.routable and key not in self._schedule:
            urgent = self._pool.in_demand(state)
            self._schedule.put(key, time.monotonic(), urgent=urgent, trial=not urgent)

    def _demanded(self, model: str) -> None:
        """A model gets requests again: its nodes' next scrapes move to the front (a failing one keeps its wait)."""
        now = time.monotonic()
        for state in self._pool.serving(model):
            key = state.entry_key
            if key not in self._backoff and not self._schedule.is_urgent(key):
                self._schedule.put(key, now, urgent=True)

    async def run(self) -> None:
        for state in list(self._pool.routable()):  # nodes that came before this task started
            self._noticed(state)
        async with asyncio.TaskGroup() as workers:  # one failing worker stops them all (a supervisor restarts)
            for _ in range(PARALLEL_SCRAPES):
                workers.create_task(self._work())

    async def _work(self) -> None:
        while True:
            key = await self._schedule.next()
            state = self._pool.get(key)
            if state is None or not state.routable:  # gone, or not routed to: scraped again once it is
                self._schedule.refund()
                self._forget(key)
                continue
            started = time.monotonic()
            answered = await self._scrape(state)
            current = self._pool.get(key)
            if current is None or not current.routable:
                self._forget(key)
                continue
            if answered:
                self._backoff.pop(key, None)
                delay = self._interval
            else:
                delay = self._backoff[key] = min(MAX_BACKOFF, max(2 * self._interval, 2 * self._backoff.get(key, 0)))
            urgent = answered and self._pool.in_demand(current)
            self._schedule.put(key, started + delay, urgent=urgent, trial=not answered)

    def _forget(self, key: str) -> None:
        self._schedule.drop(key)
        self._backoff.pop(key, None)
        self._latency.pop(key, None)
        self._hit_rates.pop(key, None)

    async def _fetch(self, url: str) -> bytes:
        """The body of ``url``'s /metrics; raises ProxyError (or TimeoutError) when the node does not give it."""
        request = UpstreamRequest(
            origin=Origin.of(url),
            path=b"/metrics",
            head=self._head,
            body=b"",
            timeout=SCRAPE_TIMEOUT,
            idle_timeout=SCRAPE_TIMEOUT,
            method=b"GET",
        )
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

    async def _scrape(self, state: NodeState) -> bool:
        """Fetch and record one node's figures; False when it did not answer."""
        try:
            page = await self._fetch(state.node.url)
        except (ProxyError, TimeoutError) as exc:
            log.debug("load scrape failed node=%s error=%s", state.node.node_id, exc)
            return False
        parsed = read_node_load(page)
        latency = read_token_latency(page)
        asleep = read_asleep(page)
        cache = read_prefix_cache(page)
        now = time.monotonic()
        self._pool.set_asleep(state, bool(asleep))
        lora = read_lora_info(page)
        if lora is not None or state.max_loras is not None:
            self._pool.set_lora(state, *(lora or (frozenset(), frozenset(), None)))
        self._pool.set_load(state, *(parsed or (0, 0, 0.0)), at=now)
        self._pool.set_finished(state, read_finished(page), now)
        if latency is not None:
            tracker = self._latency.setdefault(state.entry_key, TokenLatency())
            self._pool.set_token_latency(state, tracker.add(now, *latency))
        if cache is not None:
            rate = self._hit_rates.setdefault(state.entry_key, TokenLatency(minimum=1))
            self._pool.set_prefix_hit_rate(state, rate.add(now, *cache))
        return True
