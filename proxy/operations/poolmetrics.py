"""The /metrics page's gauges of the pool and of discovery, read from the live objects at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.events import DiscoveryState
from vllm_etcd_proxy.proxy.discovery.pool import Pool


class PoolCollector(Collector):
    """Gauges read from the pool and discovery state at scrape time."""

    def __init__(self, pool: Pool, discovery: DiscoveryState) -> None:
        self._pool = pool
        self._discovery = discovery

    def collect(self) -> Iterator[Metric]:
        nodes = GaugeMetricFamily("vllm_proxy_nodes", "Known nodes by role and status.", labels=["role", "status"])
        in_flight = GaugeMetricFamily(
            "vllm_proxy_node_in_flight", "Requests open on each node from this replica.", labels=["role", "node"]
        )
        ejected = GaugeMetricFamily("vllm_proxy_node_ejected", "1 while a node is ejected.", labels=["role", "node"])
        for role in Role:
            states = self._pool.by_role(role)
            for status in ("serving", "draining"):
                nodes.add_metric([role.value, status], sum(1 for s in states if s.node.status.value == status))
            for state in states:
                in_flight.add_metric([role.value, state.node.node_id], state.in_flight)
                ejected.add_metric([role.value, state.node.node_id], 1.0 if state.ejected else 0.0)
        yield nodes
        yield in_flight
        yield ejected
        d = self._discovery
        yield GaugeMetricFamily("vllm_proxy_etcd_enabled", "1 when pools come from etcd.", value=int(d.enabled))
        yield GaugeMetricFamily("vllm_proxy_etcd_connected", "1 while the etcd watch is up.", value=int(d.connected))
        yield GaugeMetricFamily("vllm_proxy_etcd_synced", "1 once the first list was applied.", value=int(d.synced))
        yield GaugeMetricFamily("vllm_proxy_etcd_revision", "etcd revision last applied.", value=d.revision)
        yield CounterMetricFamily("vllm_proxy_etcd_resyncs", "Re-lists after the first.", value=d.resyncs)
        yield CounterMetricFamily("vllm_proxy_etcd_reconnects", "Watch streams re-established.", value=d.reconnects)
        yield GaugeMetricFamily(
            "vllm_proxy_etcd_ignored_keys",
            "Keys ignored now because their key or value is invalid.",
            value=len(d.invalid_records),
        )
        yield CounterMetricFamily(
            "vllm_proxy_etcd_invalid_records", "Invalid keys or values seen since start.", value=d.invalid_total
        )
