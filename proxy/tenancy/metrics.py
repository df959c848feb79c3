"""The tenants' metrics. Tenant labels come from the key set only (``none`` while the API is open), so the label
set stays as small as the set; models only from those the fleet serves."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_etcd_proxy.proxy.telemetry.metrics import LabelChildren

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
OPEN = "none"
"""The tenant label of requests while no key is configured."""


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "vllm_proxy_tenant_requests", "Requests admitted, by tenant.", ["tenant"], registry=registry
        )
        self.tokens = Counter(
            "vllm_proxy_tenant_tokens",
            "Prompt + completion tokens charged to a tenant (from the nodes' usage; "
            "streams without it: their events and the prompt's estimate).",
            ["tenant"],
            registry=registry,
        )
        self.rejections = Counter(
            "vllm_proxy_tenant_rejections",
            "Requests refused, by tenant and the limit hit: rpm, tpm, concurrency (429), queue_timeout (503).",
            ["tenant", "limit"],
            registry=registry,
        )
        self.queue_left = Counter(
            "vllm_proxy_tenant_queue_abandoned",
            "Queued requests whose client went away before their turn.",
            ["tenant"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            "vllm_proxy_tenant_queue_wait_seconds",
            "Time requests waited in the replica's queue for a full model, by tenant (only requests that were queued).",
            ["tenant"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.queue_depth = Gauge(
            "vllm_proxy_queue_depth",
            "Requests waiting in this replica for a node of the model.",
            ["model"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.invalid_keys = Counter(
            "vllm_proxy_invalid_keys",
            "Client key lines (file) or values (etcd) ignored as invalid.",
            ["source"],
            registry=registry,
        )
        self.reloads = Counter(
            "vllm_proxy_key_file_reloads",
            "--api-key-file reloads on SIGHUP, by outcome (ok, failed).",
            ["outcome"],
            registry=registry,
        )
        self.replicas = Gauge(
            "vllm_proxy_limit_replicas",
            "Replicas the tenants' limits are shared among (from etcd; 1 without).",
            registry=registry,
            multiprocess_mode="liveall",
        )
        self.held = Counter(
            "vllm_proxy_tenant_held",
            "Requests that waited for capacity of their tenant's limits that another replica held, by outcome "
            "(admitted, refused).",
            ["tenant", "outcome"],
            registry=registry,
        )
        self.handovers = Counter(
            "vllm_proxy_tenant_handovers",
            "Capacity of a tenant's limit handed to another replica (given) or taken from one (taken).",
            ["tenant", "limit", "direction"],
            registry=registry,
        )
        self.child = LabelChildren()
