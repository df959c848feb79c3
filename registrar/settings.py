"""What one registrar process is told to do, after flags and environment are parsed (cli.py, whose flag
definitions hold every default)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vllm_etcd_proxy.fleet.etcd import EtcdSettings
from vllm_etcd_proxy.fleet.records import KeyLayout, Role
from vllm_etcd_proxy.fleet.tls import NodeTlsSettings

MIN_TTL = 2
"""etcd itself rounds shorter leases up; below 5 s a short etcd hiccup can cost the key (it comes back)."""
MAX_TTL = 3600
"""A dead node keeps receiving traffic for up to one TTL; more than an hour is surely a typo."""


@dataclass(frozen=True, kw_only=True)
class RegistrarSettings:
    """Everything the runner needs; built and validated by ``cli.settings_from_args``."""

    etcd: EtcdSettings
    """Endpoints, timeouts, TLS and auth for the etcd cluster."""
    role: Role
    """prefill, decode or mixed: the role segment of the key."""
    url: str
    """Base URL of the node's HTTP server, without a trailing slash; probed and written into the record."""
    node_tls: NodeTlsSettings
    """How an ``https://`` node's certificate is checked (``--node-ca-bundle``), and the client certificate shown
    to a node that requires one."""
    node_id: str
    """Last key segment; the CLI defaults it to host:port of ``url``, so a node has one key wherever it runs."""
    cluster: str
    """Cluster segment of the key: proxies of one cluster see only its nodes."""
    prefix: str
    """Key prefix shared with the proxies' ``--etcd-prefix``."""
    ttl: int
    """Lease TTL in seconds: how long a crashed node stays routable; must outlast etcd hiccups."""
    models: tuple[str, ...] | None
    """Served model names; None means ask the node's GET /v1/models (and follow LoRA adapters coming and going)."""
    labels: Mapping[str, str]
    """Free-form labels copied into the record."""
    drain_timeout: float
    """Seconds to wait on SIGTERM for running+waiting requests to reach 0: a long generation, not a hang."""
    health_interval: float
    """Seconds between health checks, and between readiness polls at start."""
    health_timeout: float
    """Seconds one probe request may take; a busy vLLM still answers /health in milliseconds."""
    unhealthy_after: int
    """Consecutive failed health checks before the node is withdrawn: one slow answer is not an outage."""
    command: tuple[str, ...]
    """Wrapper mode: the command to run as a child (everything after ``--``); empty for a sidecar."""
    kv_events: str | None
    """``tcp://HOST:PORT`` of the node's KV-event publisher, written into the record (None: none)."""
    kv_events_replay: str | None
    """``tcp://HOST:PORT`` of its replay socket (None: none)."""

    @property
    def key(self) -> str:
        """The etcd key this registrar owns."""
        return KeyLayout(prefix=self.prefix, cluster=self.cluster).key(self.role, self.node_id)
