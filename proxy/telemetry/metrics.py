"""Prometheus metrics of one replica, in a registry owned by the app (no global registry).

Names start with ``vllm_proxy_``. Pool and discovery gauges are read at scrape time from the live objects,
so the request path only touches counters and histograms.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from vllm_etcd_proxy.fleet.records import Role

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# vLLM's own buckets for these (vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds), with finer
# ones below, so the client's view and the nodes' compare bucket by bucket.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    7.5,
    10,
    20,
    40,
    80,
    160,
    640,
    2560,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1,
    2.5,
    5,
    7.5,
    10,
    20,
    40,
    80,
)
_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
LAG_INTERVAL = 0.25
"""Seconds between two event-loop lag samples."""


class _Batch:
    """Observations of one labelled histogram since they were last handed to prometheus_client: its bucket counts
    (not cumulative, as prometheus_client keeps them) and their sum."""

    __slots__ = ("_bounds", "_counts", "_total", "_seen")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one is +Inf's
        self._total, self._seen = 0.0, 0

    def add(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1  # the first bucket whose bound is >= value
        self._total += value
        self._seen += 1

    @property
    def pending(self) -> bool:
        return self._seen > 0

    def flush(self, child: Any) -> None:
        """Add what was observed to ``child`` (a ``Histogram.labels(...)`` with the same buckets) and start over.

        prometheus_client has no bulk observe: this adds to the child's own values (``_sum``, ``_buckets``),
        which ``observe`` updates one at a time; test_metrics_batch checks the result against ``observe``."""
        if not self._seen:
            return
        child._sum.inc(self._total)
        for index, count in enumerate(self._counts):
            if count:
                child._buckets[index].inc(count)
                self._counts[index] = 0
        self._total, self._seen = 0.0, 0


class _ModelFigures:
    """One model's completions since the last flush."""

    __slots__ = ("e2e", "ttft", "itl", "prompt_tokens", "generation_tokens")

    def __init__(self) -> None:
        self.e2e, self.ttft, self.itl = _Batch(_TTFT_BUCKETS), _Batch(_TTFT_BUCKETS), _Batch(_ITL_BUCKETS)
        self.prompt_tokens = self.generation_tokens = 0


class _FlushFirst(Collector):
    """Registered before every metric of the registry, so a scrape hands the batched figures over first."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        self._metrics.flush()
        return iter(())


class LabelChildren:
    """``metric.labels(*labels)``, looked up once per label set: prometheus_client's lookup takes a lock and
    builds tuples, so the request path reuses the children it has seen (the label sets are bounded)."""

    def __init__(self) -> None:
        self._children: dict[tuple[object, ...], Any] = {}

    def __call__(self, metric: Counter | Histogram | Gauge, *labels: str) -> Any:
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child


class ProxyMetrics:
    """Counters and histograms updated on the request path.

    What every request adds (its count and durations, its legs' outcomes, its chunks) and the per-model figures
    of completions (``generated``) are summed in plain dicts and handed to prometheus_client in bulk, at every
    scrape of ``registry`` and every ``LAG_INTERVAL`` s: a bisect and a few additions per request instead of
    labelled updates that take a lock each. With ``--workers`` (``immediate``), where another worker's scrape
    reads the shared files, the request counters are handed over at once; the per-model figures are up to
    ``LAG_INTERVAL`` s late there."""

    def __init__(self, registry: CollectorRegistry, *, immediate: bool = False) -> None:
        self.registry = registry
        self._immediate = immediate
        self._figures: dict[str, _ModelFigures] = {}
        self._counts: dict[tuple[Counter, tuple[str, ...]], int] = {}
        self._durations: dict[tuple[Histogram, tuple[str, ...]], _Batch] = {}
        registry.register(_FlushFirst(self))
        self.requests = Counter(
            "vllm_proxy_requests",
            "Client requests answered, by route, mode and HTTP status.",
            ["route", "mode", "status"],
            registry=registry,
        )
        self.request_seconds = Histogram(
            "vllm_proxy_request_duration_seconds",
            "Client request duration, until the last byte.",
            ["route", "mode"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.first_byte_seconds = Histogram(
            "vllm_proxy_time_to_first_byte_seconds",
            "From request received to the first body byte sent.",
            ["route", "mode"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.upstream = Counter(
            "vllm_proxy_upstream_requests",
            "Requests sent to nodes, by role, node and outcome.",
            ["role", "node", "outcome"],
            registry=registry,
        )
        self.legs = Counter(
            "vllm_proxy_legs",
            "Legs sent to nodes (each attempt), by node and what the leg asked of it: "
            "prefill (the prompt, its KV cache kept for another node), decode (the answer, from KV pulled from "
            "the prefill node), whole (the request on that one node).",
            ["node", "leg"],
            registry=registry,
        )
        self.retries = Counter(
            "vllm_proxy_retries", "Legs retried on another node before the first byte.", ["role"], registry=registry
        )
        self.stream_chunks = Counter(
            "vllm_proxy_stream_chunks", "Response body chunks relayed to clients.", registry=registry
        )
        self.client_disconnects = Counter(
            "vllm_proxy_client_disconnects", "Requests whose client went away before the end.", registry=registry
        )
        self.task_crashes = Counter(
            "vllm_proxy_background_task_crashes",
            "Background loops (probes, scrapes, discovery...) that failed and were restarted, by task.",
            ["task"],
            registry=registry,
        )
        self.resumes = Counter(
            "vllm_proxy_resumes",
            "Streams whose node failed mid-way, by what followed: resumed (a continuation "
            "from another node), completed (nothing was left to generate), failed (no node took the continuation), "
            "exhausted (--max-resumes reached).",
            ["outcome"],
            registry=registry,
        )
        self.admin_changes = Counter(
            "vllm_proxy_admin_changes", "Admin API calls that changed the pools.", ["action"], registry=registry
        )
        self.adapter_loads = Counter(
            "vllm_proxy_adapter_loads",
            "LoRA adapter loads this replica asked of nodes, by adapter and outcome: "
            "loaded, already (the node had it), failed.",
            ["adapter", "outcome"],
            registry=registry,
        )
        self.admin_denied = Counter(
            "vllm_proxy_admin_denied", "Admin API calls refused (disabled or wrong key).", registry=registry
        )
        self.tls_reloads = Counter(
            "vllm_proxy_tls_reloads",
            "Reloads of the replica's TLS certificate on SIGHUP, by outcome: ok, failed (the old one kept).",
            ["outcome"],
            registry=registry,
        )
        self.loop_lag = Gauge(
            "vllm_proxy_event_loop_lag_seconds",
            "How late the event loop ran the last timer it was given: the "
            "time every request on the replica waits behind work in progress.",
            registry=registry,
            multiprocess_mode="livemax",  # with --workers: the worst worker's
        )
        self.loop_lag_seconds = Histogram(
            "vllm_proxy_event_loop_lag_distribution_seconds",
            "Event-loop lag samples, every 0.25 s.",
            buckets=_LAG_BUCKETS,
            registry=registry,
        )
        # Completions and chat completions as their clients see them, by model (models the fleet serves: bounded).
        self.ttft_seconds = Histogram(
            "vllm_proxy_time_to_first_token_seconds",
            "Streamed completions: from the request's arrival to its first event sent to the client, by model.",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.itl_seconds = Histogram(
            "vllm_proxy_inter_token_latency_seconds",
            "Streamed completions: one stream's mean time between tokens "
            "as its client got them (its tokens from usage when the stream carries it, else its body writes), "
            "by model.",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e_seconds = Histogram(
            "vllm_proxy_e2e_request_latency_seconds",
            "Completions answered 200 (streamed or not): from the request's arrival to its last byte, by model.",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "vllm_proxy_prompt_tokens",
            "Prompt tokens of completions answered 200, from the usage the answer "
            "carries (streams only with stream_options.include_usage).",
            ["model"],
            registry=registry,
        )
        self.generation_tokens = Counter(
            "vllm_proxy_generation_tokens",
            "Generated tokens of completions answered 200, from the usage the "
            "answer carries (streams only with stream_options.include_usage).",
            ["model"],
            registry=registry,
        )
        self.websocket_sessions = Counter(
            "vllm_proxy_websocket_sessions",
            "WebSocket connections, by route and how they ended: client_closed, "
            "node_closed, node_lost (no close frame), or refused before accept (unauthorized, rate_limited, "
            "replica_full, model_not_found, no_node, upstream_failed, refused_by_node).",
            ["route", "outcome"],
            registry=registry,
        )
        self.websocket_open = Gauge(
            "vllm_proxy_websocket_sessions_open",
            "WebSocket connections relayed right now.",
            ["route"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self._child = LabelChildren()

    def _count(self, counter: Counter, labels: tuple[str, ...], n: int = 1) -> None:
        key = (counter, labels)
        self._counts[key] = self._counts.get(key, 0) + n

    def _observe(self, histogram: Histogram, labels: tuple[str, ...], value: float) -> None:
        key = (histogram, labels)
        batch = self._durations.get(key)
        if batch is None:
            batch = self._durations[key] = _Batch(_LATENCY_BUCKETS)
        batch.add(value)

    def request_done(self, route: str, mode: str, status: int, started: float) -> None:
        """A client request answered (``started``: its ``time.monotonic()``)."""
        self._count(self.requests, (route, mode, str(status)))
        self._observe(self.request_seconds, (route, mode), time.monotonic() - started)
        if self._immediate:
            self._flush_requests()

    def first_byte(self, route: str, mode: str, started: float) -> float:
        """Returns the time (``time.monotonic()``) it counted."""
        now = time.monotonic()
        self._observe(self.first_byte_seconds, (route, mode), now - started)
        return now

    def chunks(self, n: int) -> None:
        """``n`` body chunks relayed to a client."""
        self._count(self.stream_chunks, (), n)

    def generated(
        self,
        model: str,
        started: float,
        first_at: float | None,
        streamed: bool,
        writes: int,
        prompt_tokens: int | None,
        completion_tokens: int | None,
    ) -> None:
        """A completion answered 200: once per request, after its last byte."""
        now = time.monotonic()
        figures = self._figures.get(model)
        if figures is None:
            figures = self._figures[model] = _ModelFigures()
        figures.e2e.add(now - started)
        if streamed and first_at is not None:
            figures.ttft.add(first_at - started)
            tokens = completion_tokens or writes
            if tokens > 1:
                figures.itl.add((now - first_at) / (tokens - 1))
        if prompt_tokens:
            figures.prompt_tokens += prompt_tokens
        if completion_tokens:
            figures.generation_tokens += completion_tokens

    def flush(self) -> None:
        """Hand the batched figures to prometheus_client."""
        self._flush_requests()
        for model, figures in self._figures.items():
            for batch, histogram in (
                (figures.e2e, self.e2e_seconds),
                (figures.ttft, self.ttft_seconds),
                (figures.itl, self.itl_seconds),
            ):
                if batch.pending:  # a child only for what was observed, as observe() makes it
                    batch.flush(self._child(histogram, model))
            if figures.prompt_tokens:
                self._child(self.prompt_tokens, model).inc(figures.prompt_tokens)
            if figures.generation_tokens:
                self._child(self.generation_tokens, model).inc(figures.generation_tokens)
            figures.prompt_tokens = figures.generation_tokens = 0

    def _flush_requests(self) -> None:
        counts, self._counts = self._counts, {}
        for (counter, labels), n in counts.items():
            (self._child(counter, *labels) if labels else counter).inc(n)
        for (histogram, labels), batch in self._durations.items():
            if batch.pending:  # a child only for what was observed, as observe() makes it
                batch.flush(self._child(histogram, *labels))

    def upstream_outcome(self, role: Role, node_id: str, outcome: str) -> None:
        self._count(self.upstream, (role.value, node_id, outcome))

    def leg(self, node_id: str, work: str) -> None:
        self._count(self.legs, (node_id, work))

    def websocket_opened(self, route: str) -> None:
        self._child(self.websocket_open, route).inc()

    def websocket_done(self, route: str, outcome: str, *, opened: bool = False) -> None:
        """A WebSocket connection ended (``opened``: it had been accepted and counted as open)."""
        self._child(self.websocket_sessions, route, outcome).inc()
        if opened:
            self._child(self.websocket_open, route).dec()

    def resume(self, outcome: str) -> None:
        self._child(self.resumes, outcome).inc()

    def retry(self, role: Role) -> None:
        self._child(self.retries, role.value).inc()

    def tls_reloaded(self, ok: bool) -> None:
        self._child(self.tls_reloads, "ok" if ok else "failed").inc()

    async def watch_loop_lag(self) -> None:
        """Sample how late the loop wakes a sleeper, and flush the per-model figures, forever."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LAG_INTERVAL
            await asyncio.sleep(LAG_INTERVAL)
            lag = max(0.0, loop.time() - due)
            self.loop_lag.set(lag)
            self.loop_lag_seconds.observe(lag)
            self.flush()
