"""How the tenants' limits are held (tenancy/shares.py): what this replica holds of each limit and the fleet's
demand on /metrics, the replicas seen on /status."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_etcd_proxy.proxy.tenancy.admission import Tenancy
from vllm_etcd_proxy.proxy.tenancy.record import KINDS


class ShareCollector(Collector):
    """Per tenant with a limit that asked something of the fleet lately, read at scrape time."""

    def __init__(self, tenancy: Tenancy) -> None:
        self._tenancy = tenancy

    def collect(self) -> Iterator[Metric]:
        share = GaugeMetricFamily(
            "vllm_proxy_tenant_limit_share",
            "What this replica holds of a tenant's limit (rpm, tpm: per minute; concurrency: requests in flight): "
            "capacity moves to the replicas where the tenant's requests are.",
            labels=["tenant", "limit"],
        )
        demand = GaugeMetricFamily(
            "vllm_proxy_tenant_fleet_demand",
            "What the tenant asked of the whole fleet lately, from every replica's record (rpm, tpm: per minute, "
            "admitted or not; concurrency: the sum of each replica's recent peak of requests wanted in flight).",
            labels=["tenant", "limit"],
        )
        in_flight = GaugeMetricFamily(
            "vllm_proxy_tenant_in_flight",
            "The tenant's requests (and WebSocket sessions) in flight on this replica, for its concurrency limit.",
            labels=["tenant"],
        )
        tenancy = self._tenancy
        fleet, named = tenancy.fleet, tenancy.keys.tenants()
        for tenant in sorted((tenancy.counters.keys() | fleet.view.tenants()) & named.keys()):
            limits = named[tenant]
            counters = tenancy.counters.get(tenant)
            if limits.concurrency:
                in_flight.add_metric([tenant], counters.running if counters is not None else 0)
            for kind in KINDS:
                limit: int = getattr(limits, kind)
                if not limit:
                    continue
                mine = tenancy.holds(tenant, kind, limit)
                share.add_metric([tenant, kind], math.floor(mine + 1e-9) if kind == "concurrency" else mine)
                demand.add_metric([tenant, kind], fleet.demand(tenant, kind, tenancy.asking(tenant, kind)))
        yield share
        yield demand
        yield in_flight


def replicas_view(tenancy: Tenancy) -> dict[str, Any]:
    """/status's ``replicas``: the replicas this one splits the limits with, and whether its view is fresh."""
    fleet = tenancy.fleet
    return {
        "count": fleet.count,
        "me": fleet.me,
        "seen": fleet.view.members(),
        "shares": "decaying" if fleet.decay(time.monotonic()) else "fresh",
    }
