"""Builds the tenancy parts of one replica from its settings (app.py calls ``build_tenancy`` once)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from vllm_etcd_proxy.fleet.etcd import EtcdClient
from vllm_etcd_proxy.fleet.records import KeyLayout
from vllm_etcd_proxy.proxy.discovery.pool import Pool
from vllm_etcd_proxy.proxy.discovery.watch import KeySink
from vllm_etcd_proxy.proxy.settings import ProxySettings
from vllm_etcd_proxy.proxy.tenancy.admission import Tenancy
from vllm_etcd_proxy.proxy.tenancy.keys import KeySet
from vllm_etcd_proxy.proxy.tenancy.metrics import TenantMetrics
from vllm_etcd_proxy.proxy.tenancy.queue import FairQueue, QueueSettings
from vllm_etcd_proxy.proxy.tenancy.record import encode
from vllm_etcd_proxy.proxy.tenancy.replicas import FOLDER, REPLICA_TTL, ReplicaLease, ReplicaView, replica_id
from vllm_etcd_proxy.proxy.tenancy.shares import Fleet
from vllm_etcd_proxy.proxy.tenancy.sources import EtcdKeys, KeyFile

KEYS_FOLDER = "keys"


@dataclass(kw_only=True)
class TenancyParts:
    tenancy: Tenancy | None
    """None when no key can ever be configured and the queue is off: the request path skips tenancy."""
    sinks: dict[str, KeySink] = field(default_factory=dict)
    """For discovery: the ``keys/`` and ``replicas/`` folders."""
    tasks: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)
    """Background work for the lifespan: the replica's lease, and the look at its holdings every tick."""
    reload: Callable[[], None] | None = None
    """What SIGHUP runs: re-read ``--api-key-file`` (None without one)."""


def build_tenancy(
    settings: ProxySettings,
    keys: KeySet,
    registry: CollectorRegistry,
    pool: Pool,
    etcd: EtcdClient | None,
    layout: KeyLayout,
    *,
    watching: Callable[[], bool] = lambda: True,
) -> TenancyParts:
    """``watching``: whether discovery's watch is up (the shares' view is fresh only then). Raises ``ValueError``
    when ``--api-key-file`` cannot be read."""
    metrics = TenantMetrics(registry)

    def invalid(source: str) -> None:
        metrics.child(metrics.invalid_keys, source).inc()

    key_file = None
    if settings.api_key_file:
        key_file = KeyFile(settings.api_key_file, keys, invalid)
        key_file.load()
    me = replica_id()
    view = ReplicaView(me, metrics.replicas.set, least=settings.workers if etcd is None else 1)
    grace, decay = share_timing(etcd)
    fleet = Fleet(view, grace=grace, decay=decay, watching=watching)
    queue = None
    if settings.queue_timeout > 0:
        queue_settings = QueueSettings(
            timeout=settings.queue_timeout,
            max_connections=settings.max_connections,
            when_waiting=settings.queue_when_waiting,
        )

        def share(tenant: str) -> int:
            limits = keys.tenants().get(tenant)
            return limits.share if limits is not None else 1

        def depth(model: str, change: int) -> None:
            metrics.child(metrics.queue_depth, model).inc(change)

        queue = FairQueue(pool, queue_settings, share, depth)
    parts = TenancyParts(tenancy=None)
    if len(keys) or key_file is not None or etcd is not None or queue is not None:
        parts.tenancy = tenancy = Tenancy(keys, fleet, queue, metrics)
    if etcd is not None:
        parts.sinks = {KEYS_FOLDER: EtcdKeys(keys, invalid), FOLDER: view}
        lease = ReplicaLease(
            etcd,
            layout,
            me,
            lambda: encode(tenancy.reports()),
            wake=fleet.wake,
            on_refresh=fleet.refreshed,
            on_lost=tenancy.lost,
        )
        parts.tasks += [lease.run, tenancy.run]
    if key_file is not None:

        def reload_key_file() -> None:
            outcome = "ok" if key_file.reload() else "failed"
            metrics.child(metrics.reloads, outcome).inc()

        parts.reload = reload_key_file
    return parts


def share_timing(etcd: EtcdClient | None) -> tuple[float, float]:
    """(grace, decay) of the shares when etcd is away (shares.py): the lease is refreshed every ``refresh`` s, so
    two refreshes missed mean etcd is away; the decay ends a second before the others can have expired this
    replica's key (REPLICA_TTL after its last refresh) and taken its part of the limits."""
    if etcd is None:
        return 1.0, 1.0  # never used: without etcd the view is never refreshed, so never decays
    refresh = min(REPLICA_TTL / 3, etcd.settings.probe_interval)
    grace = 2 * refresh
    return grace, max(1.0, REPLICA_TTL - 1.0 - grace)
