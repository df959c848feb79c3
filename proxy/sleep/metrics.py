"""What sleep mode counts: sleeps and wakes by model and outcome, how long wakes take, and the requests that waited
for one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from vllm_etcd_proxy.proxy.telemetry.metrics import LabelChildren

_WAKE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)


class SleepMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.sleeps = Counter(
            "vllm_proxy_node_sleeps",
            "Nodes put to sleep by this replica, by model, reason (admin, idle) and outcome (ok, failed, woken: a "
            "wake came during the drain).",
            ["model", "reason", "outcome"],
            registry=registry,
        )
        self.wakes = Counter(
            "vllm_proxy_node_wakes",
            "Nodes this replica woke, by model, reason (admin, demand) and outcome (ok, failed).",
            ["model", "reason", "outcome"],
            registry=registry,
        )
        self.wake_seconds = Histogram(
            "vllm_proxy_node_wake_seconds",
            "Time a node took to wake (POST /wake_up), by model.",
            ["model"],
            buckets=_WAKE_BUCKETS,
            registry=registry,
        )
        self.waited = Counter(
            "vllm_proxy_wake_waits",
            "Requests that waited for a node of their model to wake, by model and outcome (served: a node woke; "
            "timeout: 503 after --wake-timeout; failed: no node could be woken; left: the client went away; "
            "full: 503 at once, too many waited).",
            ["model", "outcome"],
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "vllm_proxy_wake_wait_seconds",
            "Time requests waited for a node of their model to wake.",
            ["model"],
            buckets=_WAKE_BUCKETS,
            registry=registry,
        )
        self.child = LabelChildren()
