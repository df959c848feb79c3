"""Elastic prefill/decode on /metrics: requests run on one node or split (routing/elastic.py's decisions), and what
the ``both`` nodes do now, read from the live objects at scrape time. The work each node took, leg by leg, is
``vllm_proxy_legs_total{node, leg}`` (the request path counts it)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.pool import Pool
from vllm_etcd_proxy.proxy.routing.elastic import Elastic, work


class ElasticCollector(Collector):
    def __init__(self, pool: Pool, elastic: Elastic) -> None:
        self._pool, self._elastic = pool, elastic

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            "vllm_proxy_elastic_requests",
            "Requests to both nodes, by decision (local: one node; split: prefill on one, decode on another) and "
            "reason (few_new, one_token, no_pair, no_gain; split, unknown: the prompt's size was not known).",
            labels=["decision", "reason"],
        )
        for (decision, reason), count in sorted(self._elastic.decisions.items()):
            decisions.add_metric([decision, reason], count)
        yield decisions
        working = GaugeMetricFamily(
            "vllm_proxy_elastic_nodes",
            "Routable both nodes by the work they have now, as routing/elastic.py reckons it: prefill (prompts "
            "computed or waiting there), decode (sequences generating, no prompt), idle.",
            labels=["work"],
        )
        counts = {"prefill": 0, "decode": 0, "idle": 0}
        for state in self._pool.routable():
            if state.node.role is Role.BOTH:
                prompts, decoding = work(state)
                counts["prefill" if prompts >= 0.5 else "decode" if decoding >= 0.5 else "idle"] += 1
        for kind, count in counts.items():
            working.add_metric([kind], count)
        yield working
