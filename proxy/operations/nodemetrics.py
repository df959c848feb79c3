"""The fleet on every replica's /metrics: what the load scrape read from each node, re-exported as gauges
``vllm_proxy_node_*{node, role, model}``, and how many nodes can take each model's requests.

Read from the pool at scrape time (nothing on the request path), so a node that leaves the pool leaves these
series with it: the label sets stay as large as the fleet is now. ``model`` is the node's first served model
(vLLM lists the base model first, then its LoRA adapters): one series per node, whose figures are the node's
own, summed over its engines.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_etcd_proxy.proxy.discovery.pool import Pool

_LABELS = ["node", "role", "model"]


class NodeCollector(Collector):
    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, text: str, labels: list[str] = _LABELS) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"vllm_proxy_node_{name}", text, labels=labels)

        running = gauge("running", "Requests the node is running (every client's), from its vllm:num_requests_running.")
        waiting = gauge("waiting", "Requests waiting in the node's queue, from its vllm:num_requests_waiting.")
        kv = gauge("kv_cache_usage", "The node's KV-cache usage, 0 to 1, from its vllm:kv_cache_usage_perc.")
        hits = gauge(
            "prefix_cache_hit_rate",
            "The node's prefix-cache hits per queried prompt token over the last "
            "seconds, from its vllm:prefix_cache_hits_total and vllm:prefix_cache_queries_total.",
        )
        itl = gauge(
            "inter_token_latency_seconds",
            "The node's mean time between output tokens over the last seconds, "
            "from its vllm:inter_token_latency_seconds.",
        )
        age = gauge("scrape_age_seconds", "Seconds since the node's /metrics was last read (--scrape-load).")
        routable = gauge("routable", "1 while this replica routes to the node (serving, models known, not ejected).")
        per_model = GaugeMetricFamily(
            "vllm_proxy_model_routable_nodes",
            "Nodes of each role this replica can route a model's requests to.",
            labels=["model", "role"],
        )
        counts: dict[tuple[str, str], int] = {}
        now = time.monotonic()
        for state in self._pool.all():
            role = state.node.role.value
            labels = [state.node.node_id, role, state.models[0] if state.models else ""]
            routable.add_metric(labels, 1.0 if state.routable else 0.0)
            for model in state.models:
                counts[model, role] = counts.get((model, role), 0) + state.routable
            if state.load_at is None:
                continue
            running.add_metric(labels, state.node_running)
            waiting.add_metric(labels, state.node_waiting)
            kv.add_metric(labels, state.kv_usage)
            age.add_metric(labels, round(now - state.load_at, 3))
            if state.prefix_hit_rate is not None:
                hits.add_metric(labels, state.prefix_hit_rate)
            if state.node_itl is not None:
                itl.add_metric(labels, state.node_itl)
        for (model, role), count in sorted(counts.items()):
            per_model.add_metric([model, role], count)
        yield from (running, waiting, kv, hits, itl, age, routable, per_model)
