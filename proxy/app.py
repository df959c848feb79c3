"""Wiring: builds the pool, balancer, forwarder and routes for one replica, and runs discovery in the
lifespan. Nothing here is global: every object is made by ``build_app`` and passed to what uses it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_etcd_proxy.fleet.adapters import FOLDER as ADAPTERS
from vllm_etcd_proxy.fleet.etcd import EtcdClient
from vllm_etcd_proxy.fleet.httpclient import stateless_client
from vllm_etcd_proxy.fleet.records import InvalidRecord, KeyLayout, Node, Role, Source, split_host_port, validate_url
from vllm_etcd_proxy.proxy.discovery.adapters import AdapterRegistry
from vllm_etcd_proxy.proxy.discovery.ejection import Ejector
from vllm_etcd_proxy.proxy.discovery.events import DiscoveryState
from vllm_etcd_proxy.proxy.discovery.kvnodes import KvSubscribers
from vllm_etcd_proxy.proxy.discovery.loadwatch import LoadWatcher
from vllm_etcd_proxy.proxy.discovery.pool import Pool
from vllm_etcd_proxy.proxy.discovery.prober import ModelProber
from vllm_etcd_proxy.proxy.discovery.watch import Discovery
from vllm_etcd_proxy.proxy.errors import MethodNotAllowed, NotFound, ProxyError, render
from vllm_etcd_proxy.proxy.operations.admin import AdminRoutes
from vllm_etcd_proxy.proxy.operations.dashboard import DashboardRoutes
from vllm_etcd_proxy.proxy.operations.info import InfoRoutes, Lifecycle, not_ready_reason
from vllm_etcd_proxy.proxy.operations.kvmetrics import KvCollector, KvView
from vllm_etcd_proxy.proxy.operations.metrics import PoolCollector, ProxyMetrics
from vllm_etcd_proxy.proxy.operations.models import ModelRoutes
from vllm_etcd_proxy.proxy.operations.nodemetrics import NodeCollector
from vllm_etcd_proxy.proxy.operations.workers import METRICS_DIR_ENV
from vllm_etcd_proxy.proxy.routing.balancer import (
    AFFINITY_POLICIES,
    DEFAULT_POLICIES,
    KV_AWARE,
    CacheAware,
    make_policy,
)
from vllm_etcd_proxy.proxy.routing.kvchoice import KvAware, KvRouting
from vllm_etcd_proxy.proxy.routing.kvindex import KvIndex
from vllm_etcd_proxy.proxy.routing.tokens import PromptTokens
from vllm_etcd_proxy.proxy.serving.adapters import AdapterLoader
from vllm_etcd_proxy.proxy.serving.api import OpenAIRoutes
from vllm_etcd_proxy.proxy.serving.forwarder import Forwarder
from vllm_etcd_proxy.proxy.serving.guard import ClientKeys, ConcurrencyLimit, HeaderLimit
from vllm_etcd_proxy.proxy.serving.websocket import WebSocketProxy
from vllm_etcd_proxy.proxy.settings import ProxySettings
from vllm_etcd_proxy.proxy.tenancy.setup import build_tenancy
from vllm_etcd_proxy.proxy.tracing.spans import make_tracer
from vllm_etcd_proxy.proxy.upstream.transport import HttpTransport, Transport

log = logging.getLogger(__name__)

CLIENT_PRUNE_INTERVAL = 30.0
"""Seconds between closing the idle connections of nodes that left."""


def static_node(
    role: Role,
    address: str,
    models: tuple[str, ...],
    kv: tuple[str | None, str | None] = (None, None),
) -> Node:
    """A node from a --prefill/--decode/--mixed flag: ``host:port`` or an http(s) URL; ``kv``: its --kv-events."""
    if "://" in address:
        url = validate_url(address)
        node_id = url.split("://", 1)[1]
    else:
        host, port = split_host_port(address)
        url, node_id = f"http://{host}:{port}", address
    return Node(
        node_id=node_id,
        role=role,
        url=url,
        models=models,
        source=Source.STATIC,
        learn_models=not models,
        kv_events=kv[0],
        kv_events_replay=kv[1],
    )


def error_response(exc: ProxyError) -> Response:
    status, headers, body = render(exc)
    response = Response(body, status_code=status)
    response.raw_headers = headers
    return response


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


class ProxyApp:
    """The ASGI app of one replica: the header limit, then the raw OpenAI routes, then starlette for the rest."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, prompt_tokens: PromptTokens) -> None:
        self._app = app
        self.lifecycle = lifecycle
        self.prompt_tokens = prompt_tokens
        """Requests to token ids (``prompt_tokens.ids``), for routing on the nodes' cached blocks."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


def build_app(settings: ProxySettings, transport: Transport | None = None, *, wait_ready: float = 0.0) -> ProxyApp:
    """The ASGI app of one replica; ``transport`` carries requests to the nodes (tests pass their own).

    With ``wait_ready`` the app's startup waits up to that many seconds for the replica to be ready (pools
    synced, a node routable), so that the server only listens then: a worker restarted beside others takes no
    connection it would answer with 404 or 503.
    """
    lifecycle = Lifecycle()
    registry = CollectorRegistry(auto_describe=True)
    metrics = ProxyMetrics(registry)
    pool = Pool()
    discovery_state = DiscoveryState(enabled=settings.etcd is not None)
    registry.register(PoolCollector(pool, discovery_state))
    registry.register(NodeCollector(pool))
    layout = KeyLayout(prefix=settings.etcd_prefix, cluster=settings.cluster)
    kv_flags = {node: (events, replay) for node, events, replay in settings.kv_events}
    for role, addresses in (
        (Role.PREFILL, settings.prefill),
        (Role.DECODE, settings.decode),
        (Role.MIXED, settings.mixed),
    ):
        for address in addresses:
            try:
                pool.add(static_node(role, address, settings.models, kv_flags.get(address, (None, None))))
            except InvalidRecord as exc:
                raise ValueError(f"--{role.value} {address}: {exc}") from None
    if unknown := set(kv_flags) - {*settings.prefill, *settings.decode, *settings.mixed}:
        raise ValueError(f"--kv-events names no static node: {', '.join(sorted(unknown))}")

    # Probes and the admin API: a few requests per node and minute.
    client = stateless_client(timeout=httpx.Timeout(settings.timeouts.connect, read=30.0), follow_redirects=False)
    http = HttpTransport(connect_timeout=settings.timeouts.connect, max_connections=settings.max_connections)
    # The load scrapes' own connections (one per node): a node busy up to --max-connections is still scraped.
    scrapes = HttpTransport(connect_timeout=settings.timeouts.connect, max_connections=1)
    if transport is None:
        transport = http
    chosen = dict(settings.policies)

    # KV-cache events: a subscriber per publishing node feeds one index, which the kv-aware policy reads.
    kv_index = KvIndex()
    kv_subscribers = KvSubscribers(pool, kv_index)
    kv_routing = KvRouting(kv_index, kv_subscribers.tracked, kv_subscribers.active)
    registry.register(KvCollector(kv_subscribers, kv_routing))

    def kv_policy(name: str) -> KvAware:
        return KvAware(kv_routing, CacheAware())

    policies = {
        role: kv_policy(name)
        if (name := chosen.get(role.value, DEFAULT_POLICIES[role.value])) == KV_AWARE
        else make_policy(name)
        for role in Role
    }
    ejector = Ejector(pool, client, settings.ejection)
    forwarder = Forwarder(transport, pool, policies, settings, metrics, ejector)
    etcd = EtcdClient(settings.etcd) if settings.etcd is not None else None
    backend_auth = {"authorization": f"Bearer {settings.backend_api_key}"} if settings.backend_api_key else None
    prober = ModelProber(pool, client, settings.models_refresh, backend_auth, rate=settings.models_probe_rate)
    keys = ClientKeys(settings.api_keys)
    tenancy = build_tenancy(settings, keys, registry, pool, etcd, layout)  # keys' tenants, limits, fair queue
    tracer = make_tracer(settings.otlp_traces_endpoint)  # None unless configured: then no span is ever made
    prompt_tokens = PromptTokens(
        dict(settings.tokenizers),
        lambda model: [s.cards[model] for s in pool.serving(model) if model in s.cards],
        registry,
    )
    pool.on_node(prompt_tokens.node_seen)
    adapters = AdapterRegistry()  # LoRA adapters registered in etcd, loaded where requests need them (issue 19)
    loader = AdapterLoader(pool, adapters, client, metrics, backend_auth)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        http.prepare_tls()
        kv_subscribers.start()
        prompt_tokens.start()
        if tracer is not None:
            tracer.start()

        async def prune_connections() -> None:
            while True:
                await asyncio.sleep(CLIENT_PRUNE_INTERVAL)
                live = {s.node.url for s in pool.all()}
                http.prune(live)
                scrapes.prune(live)

        tasks = [
            asyncio.create_task(prober.run(), name="model-prober"),
            asyncio.create_task(ejector.run(), name="ejection-prober"),
            asyncio.create_task(prune_connections(), name="connection-pruner"),
            asyncio.create_task(metrics.watch_loop_lag(), name="loop-lag"),
        ]
        if settings.scrape_load > 0:
            watcher = LoadWatcher(pool, scrapes, settings.scrape_load, backend_auth, rate=settings.scrape_rate)
            tasks.append(asyncio.create_task(watcher.run(), name="load-watcher"))
        if etcd is not None:
            discovery = Discovery(
                etcd, layout, pool.apply_all, discovery_state, sinks={ADAPTERS: adapters, **tenancy.sinks}
            )
            tasks.append(asyncio.create_task(discovery.run(), name="etcd-discovery"))
        tasks += [asyncio.create_task(run(), name="tenancy") for run in tenancy.tasks]
        deadline = time.monotonic() + wait_ready
        while (
            time.monotonic() < deadline
            and not lifecycle.shutting_down
            and not_ready_reason(lifecycle, discovery_state, pool) is not None
        ):
            await asyncio.sleep(0.05)
        try:
            yield
        finally:
            loader.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await kv_subscribers.stop()
            if etcd is not None:
                await etcd.close()
            await client.aclose()
            prompt_tokens.close()
            http.close()
            scrapes.close()
            if tracer is not None:
                await asyncio.to_thread(tracer.shutdown)

    scraped = registry
    if os.environ.get(METRICS_DIR_ENV):
        # One of several workers (workers.py): counters and histograms summed over all of them, pool gauges ours.
        scraped = CollectorRegistry(auto_describe=True)
        MultiProcessCollector(scraped)  # type: ignore[no-untyped-call]
        scraped.register(PoolCollector(pool, discovery_state))
        scraped.register(NodeCollector(pool))
        scraped.register(KvCollector(kv_subscribers, kv_routing))
    routes = [
        *InfoRoutes(
            pool=pool,
            discovery=discovery_state,
            registry=scraped,
            lifecycle=lifecycle,
            kv_view=KvView(kv_subscribers, kv_routing),
        ).routes(),
        *AdminRoutes(
            pool=pool,
            client=client,
            admin_key=settings.admin_key,
            etcd=etcd,
            layout=layout,
            models=settings.models,
            metrics=metrics,
            allowed=settings.admin_allow,
            backend_auth=backend_auth,
        ).routes(),
        *ModelRoutes(pool, keys, adapters).routes(),
        *DashboardRoutes().routes(),
    ]
    operator_app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={ProxyError: _proxy_error, HTTPException: _http_error},
    )
    openai = OpenAIRoutes(
        settings,
        pool,
        forwarder,
        metrics,
        ConcurrencyLimit(settings.max_concurrent),
        operator_app,
        keys=keys,
        websockets=WebSocketProxy(pool, policies, keys, metrics, settings),
        affinity=any(p.name in AFFINITY_POLICIES for p in policies.values()),
        tracer=tracer,
        adapters=loader,
        tenancy=tenancy.tenancy,
        kv=kv_routing,
        prompt_ids=prompt_tokens.ids,
    )
    return ProxyApp(HeaderLimit(openai, max_bytes=settings.max_header_bytes), lifecycle, prompt_tokens)
