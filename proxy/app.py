"""Wiring: builds the pool, balancer, forwarder and routes for one replica, and runs discovery in the
lifespan. Nothing here is global: every object is made by ``build_app`` and passed to what uses it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxy.admin import AdminRoutes
from proxy.api import OpenAIRoutes
from proxy.balancer import make_policy
from proxy.discovery import Discovery
from proxy.ejection import Ejector
from proxy.errors import MethodNotAllowed, NotFound, ProxyError
from proxy.etcd import EtcdClient
from proxy.events import DiscoveryState
from proxy.forwarder import Forwarder
from proxy.guard import ConcurrencyLimit, HeaderLimit
from proxy.httpclient import stateless_client
from proxy.info import InfoRoutes, Lifecycle
from proxy.loadwatch import LoadWatcher
from proxy.metrics import PoolCollector, ProxyMetrics
from proxy.pool import Pool
from proxy.prober import ModelProber
from proxy.records import InvalidRecord, KeyLayout, Node, Role, Source, split_host_port, validate_url
from proxy.settings import ProxySettings
from proxy.upstream import NodeClients

log = logging.getLogger(__name__)

CLIENT_PRUNE_INTERVAL = 30.0
"""Seconds between closing the connection pools of nodes that left."""


def static_node(role: Role, address: str, models: tuple[str, ...]) -> Node:
    """A node from a --prefill/--decode/--mixed flag: ``host:port`` or an http(s) URL."""
    if "://" in address:
        url = validate_url(address)
        node_id = url.split("://", 1)[1]
    else:
        host, port = split_host_port(address)
        url, node_id = f"http://{host}:{port}", address
    return Node(node_id=node_id, role=role, url=url, models=models, source=Source.STATIC, learn_models=not models)


def error_response(exc: ProxyError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _proxy_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProxyError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return error_response(MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}"))
    if exc.status_code == 404:
        return error_response(NotFound(f"no route {request.url.path}"))
    return error_response(ProxyError(str(exc.detail)))


def build_app(settings: ProxySettings) -> Starlette:
    """The ASGI app of one replica."""
    lifecycle = Lifecycle()
    registry = CollectorRegistry(auto_describe=True)
    metrics = ProxyMetrics(registry)
    pool = Pool()
    discovery_state = DiscoveryState(enabled=settings.etcd is not None)
    registry.register(PoolCollector(pool, discovery_state))
    layout = KeyLayout(prefix=settings.etcd_prefix, cluster=settings.cluster)
    for role, addresses in ((Role.PREFILL, settings.prefill), (Role.DECODE, settings.decode),
                            (Role.MIXED, settings.mixed)):  # fmt: skip
        for address in addresses:
            try:
                pool.add(static_node(role, address, settings.models))
            except InvalidRecord as exc:
                raise ValueError(f"--{role.value} {address}: {exc}") from None

    t = settings.timeouts

    def make_client() -> httpx.AsyncClient:
        return stateless_client(
            timeout=httpx.Timeout(connect=t.connect, read=None, write=60.0, pool=t.first_byte),
            limits=httpx.Limits(max_connections=settings.max_connections,
                                max_keepalive_connections=settings.max_connections, keepalive_expiry=60.0),
            follow_redirects=False,
        )  # fmt: skip

    client = make_client()  # probes and the admin API: a few requests per node and minute
    node_clients = NodeClients(make_client)
    overrides = dict(settings.role_policies)
    policies = {role: make_policy(overrides.get(role.value, settings.policy)) for role in Role}
    ejector = Ejector(pool, client, settings.ejection)
    forwarder = Forwarder(node_clients, pool, policies, settings, metrics, ejector)
    etcd = EtcdClient(settings.etcd) if settings.etcd is not None else None
    backend_auth = {"authorization": f"Bearer {settings.backend_api_key}"} if settings.backend_api_key else None
    prober = ModelProber(pool, client, settings.models_refresh, backend_auth)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async def prune_clients() -> None:
            while True:
                await asyncio.sleep(CLIENT_PRUNE_INTERVAL)
                await node_clients.prune(s.node.url for s in pool.all())

        tasks = [asyncio.create_task(prober.run(), name="model-prober"),
                 asyncio.create_task(ejector.run(), name="ejection-prober"),
                 asyncio.create_task(prune_clients(), name="client-pruner")]  # fmt: skip
        if settings.scrape_load > 0:
            watcher = LoadWatcher(pool, client, settings.scrape_load, backend_auth)
            tasks.append(asyncio.create_task(watcher.run(), name="load-watcher"))
        if etcd is not None:
            discovery = Discovery(etcd, layout, pool.apply, discovery_state)
            tasks.append(asyncio.create_task(discovery.run(), name="etcd-discovery"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if etcd is not None:
                await etcd.close()
            await client.aclose()
            await node_clients.aclose()

    routes = [
        *InfoRoutes(pool=pool, discovery=discovery_state, registry=registry, lifecycle=lifecycle).routes(),
        *AdminRoutes(pool=pool, client=client, admin_key=settings.admin_key, etcd=etcd, layout=layout,
                     models=settings.models, metrics=metrics, allowed=settings.admin_allow,
                     backend_auth=backend_auth).routes(),  # fmt: skip
        *OpenAIRoutes(settings, pool, forwarder, metrics, ConcurrencyLimit(settings.max_concurrent),
                      affinity=any(p.name == "consistent-hash" for p in policies.values())).routes(),  # fmt: skip
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={ProxyError: _proxy_error, HTTPException: _http_error},
        middleware=[Middleware(HeaderLimit, max_bytes=settings.max_header_bytes)],
    )
    app.state.lifecycle = lifecycle
    return app
