"""Read-only routes for operators and orchestrators: /health, /ready, /status, /list_models, /list_workers,
/metrics. None of them reveals a secret."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.events import DiscoveryState
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool


def worker_view(state: NodeState) -> dict[str, Any]:
    node = state.node
    return {
        "id": node.node_id,
        "url": node.url,
        "role": node.role.value,
        "models": list(state.models),
        "status": node.status.value,
        "healthy": not state.ejected,
        "ejected": state.ejected,
        "asleep": state.asleep,
        "sleep": node.sleep.value or "awake",
        "models_known": state.models_known,
        "in_flight": state.in_flight,
        "served": state.served,
        "consecutive_failures": state.failures,
        "source": node.source.value,
        "labels": dict(node.labels),
        "node_load": _node_load(state),
    }


def _node_load(state: NodeState) -> dict[str, Any] | None:
    """What the last scrape of the node's /metrics said (--scrape-load), and how old it is; None if never."""
    if state.load_at is None:
        return None
    return {
        "running": state.node_running,
        "waiting": state.node_waiting,
        "kv_cache_usage": state.kv_usage,
        "inter_token_latency_seconds": state.node_itl,
        "prefix_cache_hit_rate": state.prefix_hit_rate,
        "age_seconds": round(time.monotonic() - state.load_at, 3),
    }


@dataclass(kw_only=True)
class Lifecycle:
    """Set by the CLI's signal handling: a replica shutting down reports not ready before it stops listening."""

    shutting_down: bool = False


def not_ready_reason(
    lifecycle: Lifecycle, discovery: DiscoveryState, pool: Pool, kv_catching_up: int = 0
) -> str | None:
    """Why the replica should not get traffic now (what /ready answers), or None."""
    if lifecycle.shutting_down:
        return "shutting down"
    if discovery.enabled and not discovery.synced:
        return "etcd discovery has not synced yet"
    if not pool.routable():
        return "no routable node"
    if kv_catching_up:
        return f"replaying the KV-cache events of {kv_catching_up} node(s)"
    return None


class InfoRoutes:
    def __init__(
        self,
        *,
        pool: Pool,
        discovery: DiscoveryState,
        registry: CollectorRegistry,
        lifecycle: Lifecycle,
        kv_view: Callable[[NodeState], dict[str, Any] | None] | None = None,
        kv_catching_up: Callable[[], int] = lambda: 0,
        replicas: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``replicas``: the replicas the tenants' limits are split with, for /status (None without tenancy)."""
        self._replicas = replicas
        self._kv_view = kv_view
        self._kv_catching_up = kv_catching_up
        self._lifecycle = lifecycle
        self._pool = pool
        self._discovery = discovery
        self._registry = registry

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/status", self.status, methods=["GET", "POST"]),
            Route("/list_models", self.list_models, methods=["GET", "POST"]),
            Route("/list_workers", self.list_workers, methods=["GET", "POST"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        reason = not_ready_reason(self._lifecycle, self._discovery, self._pool, self._kv_catching_up())
        if reason is None:
            return JSONResponse({"ready": True})
        return JSONResponse({"ready": False, "reason": reason}, status_code=503, headers={"Retry-After": "1"})

    def discovery_view(self) -> dict[str, Any]:
        d = self._discovery
        return {
            "source": "etcd" if d.enabled else "static",
            "synced": d.synced if d.enabled else True,
            "connected": d.connected,
            "revision": d.revision,
            "endpoint": d.endpoint,
            "last_error": d.last_error,
            "resyncs": d.resyncs,
            "reconnects": d.reconnects,
            "invalid_keys": dict(d.invalid_records),
            "invalid_total": d.invalid_total,
        }

    async def status(self, request: Request) -> Response:
        body: dict[str, Any] = {}
        for role in Role:
            states = self._pool.by_role(role)
            body[f"{role.value}_node_count"] = len(states)
            body[f"{role.value}_nodes"] = sorted(s.node.host_port for s in states)
        body["models"] = self._pool.models()
        body["discovery"] = self.discovery_view()
        if self._replicas is not None:
            body["replicas"] = self._replicas()
        return JSONResponse(body)

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"models": self._pool.models()})

    async def list_workers(self, request: Request) -> Response:
        kv = self._kv_view
        workers = sorted(
            ({**worker_view(s), "kv_events": kv(s) if kv is not None else None} for s in self._pool.all()),
            key=lambda w: (w["role"], w["id"]),
        )
        return JSONResponse({"workers": workers})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)
