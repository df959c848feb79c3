"""What the KV-event index shows: each node's subscriber on /list_workers, and counters on /metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.kvcache.nodes import KvSubscribers
from vllm_etcd_proxy.proxy.kvcache.subscription import LAG_BUCKETS
from vllm_etcd_proxy.proxy.routing.kv_aware import KvRouting

REASONS = ("cached_prefix", "load", "fallback")


class KvView:
    """One node's subscriber state and index figures, for /list_workers (None: it publishes no events)."""

    def __init__(self, subscribers: KvSubscribers, routing: KvRouting) -> None:
        self._subscribers, self._routing = subscribers, routing

    def __call__(self, state: NodeState) -> dict[str, Any] | None:
        view = self._subscribers.view(state.entry_key)
        if view is None:
            return None
        blocks = self._routing.index.node(state.entry_key)
        view["blocks_indexed"] = len(blocks.blocks) if blocks is not None else 0
        view["block_size"] = blocks.block_size if blocks is not None else None
        view["orphan_blocks"] = blocks.orphans if blocks is not None else 0
        view["conversations"] = self._routing.conversations(state, time.monotonic())
        view["conversations_begun"] = blocks.conversations.begun if blocks is not None else 0
        return view


class KvCollector(Collector):
    """Counters of the events this replica took in and of its kv-aware routing decisions, read at scrape time."""

    def __init__(self, subscribers: KvSubscribers, routing: KvRouting) -> None:
        self._subscribers, self._routing = subscribers, routing

    def collect(self) -> Iterator[Metric]:
        stats = self._subscribers.stats
        for name, value, text in (
            ("kv_event_batches", stats.batches, "KV-event batches applied to the index."),
            ("kv_events", stats.events, "KV-cache events (stores, removals, clears) applied to the index."),
            ("kv_event_gaps", stats.gaps, "Jumps in a node's event sequence numbers."),
            ("kv_event_replays", stats.replays, "Replays asked of nodes' replay sockets."),
            ("kv_event_malformed", stats.malformed, "Malformed KV-event frames or events, skipped."),
            ("kv_event_restarts", stats.restarts, "Nodes seen restarting (sequence numbers going back)."),
        ):
            yield CounterMetricFamily(f"vllm_proxy_{name}", text, value=value)
        counts, total = list(stats.lag_counts), 0
        buckets = []
        for bound, count in zip((*(str(b) for b in LAG_BUCKETS), "+Inf"), counts, strict=True):
            total += count
            buckets.append((bound, total))
        yield HistogramMetricFamily(
            "vllm_proxy_kv_event_lag_seconds",
            "From a live KV-event batch's publishing (its timestamp) to its blocks being in the index.",
            buckets=buckets,
            sum_value=stats.lag_sum,
        )
        decisions = CounterMetricFamily(
            "vllm_proxy_kv_routing_decisions",
            "kv-aware routing decisions by reason: "
            "cached_prefix, load (no node holds the prefix), fallback (content "
            "affinity: no events for the request or its nodes).",
            labels=["reason"],
        )
        counted = self._routing.decisions
        for reason in REASONS:
            decisions.add_metric([reason], counted.get(reason, 0))
        yield decisions
        yield GaugeMetricFamily(
            "vllm_proxy_kv_index_blocks", "Distinct block keys in the KV-event index.", value=len(self._routing.index)
        )
