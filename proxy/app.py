"""Wiring: builds the pool, balancer, forwarder and routes for one replica, and runs discovery in the
lifespan. Nothing here is global: every object is made by ``build_app`` and passed to what uses it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_etcd_proxy.fleet.adapters import FOLDER as ADAPTERS
from vllm_etcd_proxy.fleet.etcd import EtcdClient
from vllm_etcd_proxy.fleet.httpclient import stateless_client
from vllm_etcd_proxy.fleet.records import InvalidRecord, KeyLayout, Node, Role, Source, split_host_port, validate_url
from vllm_etcd_proxy.proxy.discovery.adapters import AdapterRegistry
from vllm_etcd_proxy.proxy.discovery.claims import FOLDER as CLAIMS
from vllm_etcd_proxy.proxy.discovery.claims import Claims, EtcdClaims, LocalClaims
from vllm_etcd_proxy.proxy.discovery.ejection import Ejector
from vllm_etcd_proxy.proxy.discovery.events import DiscoveryState
from vllm_etcd_proxy.proxy.discovery.loadwatch import LoadWatcher
from vllm_etcd_proxy.proxy.discovery.pool import Pool
from vllm_etcd_proxy.proxy.discovery.prober import ModelProber
from vllm_etcd_proxy.proxy.discovery.watch import Discovery
from vllm_etcd_proxy.proxy.errors import MethodNotAllowed, NotFound, ProxyError, render
from vllm_etcd_proxy.proxy.kvcache.index import KvIndex
from vllm_etcd_proxy.proxy.kvcache.nodes import KvSubscribers
from vllm_etcd_proxy.proxy.kvcache.prompt.tokens import PromptTokens
from vllm_etcd_proxy.proxy.operations.admin import AdminRoutes
from vllm_etcd_proxy.proxy.operations.dashboard import DashboardRoutes
from vllm_etcd_proxy.proxy.operations.elasticmetrics import ElasticCollector
from vllm_etcd_proxy.proxy.operations.hangup import Hangup, StartHangups
from vllm_etcd_proxy.proxy.operations.info import InfoRoutes, Lifecycle, not_ready_reason
from vllm_etcd_proxy.proxy.operations.kvmetrics import KvCollector, KvView
from vllm_etcd_proxy.proxy.operations.models import ModelRoutes
from vllm_etcd_proxy.proxy.operations.nodemetrics import NodeCollector
from vllm_etcd_proxy.proxy.operations.nodeops import NodeOpsRoutes
from vllm_etcd_proxy.proxy.operations.poolmetrics import PoolCollector
from vllm_etcd_proxy.proxy.operations.sharemetrics import ShareCollector, replicas_view
from vllm_etcd_proxy.proxy.operations.tls import ServerTls, server_tls
from vllm_etcd_proxy.proxy.operations.workers import METRICS_DIR_ENV
from vllm_etcd_proxy.proxy.routing.balancer import (
    AFFINITY_POLICIES,
    DEFAULT_POLICIES,
    KV_AWARE,
    CacheAware,
    Policy,
    make_policy,
)
from vllm_etcd_proxy.proxy.routing.elastic import Elastic
from vllm_etcd_proxy.proxy.routing.kv_aware import KvAware, KvRouting
from vllm_etcd_proxy.proxy.serving.adapters import AdapterLoader
from vllm_etcd_proxy.proxy.serving.api import OpenAIRoutes
from vllm_etcd_proxy.proxy.serving.flows import Flows
from vllm_etcd_proxy.proxy.serving.forwarder import Forwarder
from vllm_etcd_proxy.proxy.serving.guard import ClientKeys, ConcurrencyLimit, HeaderLimit
from vllm_etcd_proxy.proxy.serving.layers import (
    Accounting,
    Admission,
    Answer,
    Concurrency,
    Handler,
    Keys,
    PickFlow,
    ReadRequest,
    TenantLimits,
    Tracing,
    Wake,
)
from vllm_etcd_proxy.proxy.serving.parsing import BodyLimits
from vllm_etcd_proxy.proxy.serving.relay import Relay
from vllm_etcd_proxy.proxy.serving.sessions import SessionFlow, SessionRelay
from vllm_etcd_proxy.proxy.settings import ProxySettings
from vllm_etcd_proxy.proxy.sleep.setup import build_sleep
from vllm_etcd_proxy.proxy.supervisor import Supervisor
from vllm_etcd_proxy.proxy.telemetry.metrics import ProxyMetrics
from vllm_etcd_proxy.proxy.telemetry.spans import make_tracer
from vllm_etcd_proxy.proxy.tenancy.replicas import replica_id
from vllm_etcd_proxy.proxy.tenancy.setup import build_tenancy
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

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, prompt_tokens: PromptTokens, tls: ServerTls | None) -> None:
        self._app = app
        self.lifecycle = lifecycle
        self.prompt_tokens = prompt_tokens
        """Requests to token ids (``prompt_tokens.ids``), for routing on the nodes' cached blocks."""
        self.ssl_context = tls.context if tls is not None else None
        """The listener's server context (the same one for its whole life: SIGHUP reloads into it); None: plain
        HTTP."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


def _hangup(
    key_file: Callable[[], None] | None, tls: ServerTls | None, metrics: ProxyMetrics, at_start: StartHangups | None
) -> Hangup:
    """What SIGHUP re-reads: the key file, the TLS certificate (each when configured)."""
    hangup = Hangup(at_start)
    if key_file is not None:
        hangup.on("--api-key-file", key_file)
    if tls is not None:
        hangup.on("TLS certificate", lambda: metrics.tls_reloaded(tls.reload()))
    return hangup


def static_pool(settings: ProxySettings) -> Pool:
    """The pool, with the nodes given on the command line (``--prefill``/``--decode``/``--mixed``/``--both``)."""
    pool = Pool()
    kv_flags = {node: (events, replay) for node, events, replay in settings.kv_events}
    for role, addresses in (
        (Role.PREFILL, settings.prefill),
        (Role.DECODE, settings.decode),
        (Role.MIXED, settings.mixed),
        (Role.BOTH, settings.both),
    ):
        for address in addresses:
            try:
                pool.add(static_node(role, address, settings.models, kv_flags.get(address, (None, None))))
            except InvalidRecord as exc:
                raise ValueError(f"--{role.value} {address}: {exc}") from None
    if unknown := set(kv_flags) - {*settings.prefill, *settings.decode, *settings.mixed, *settings.both}:
        raise ValueError(f"--kv-events names no static node: {', '.join(sorted(unknown))}")
    return pool


class Replica:
    """Every part of one replica, built from its settings and passed to what uses it: discovery -> pool ->
    balancer -> forwarder -> the request path, and what runs beside it. ``lifespan`` runs the background work."""

    def __init__(
        self, settings: ProxySettings, transport: Transport | None = None, hangups: StartHangups | None = None
    ) -> None:
        self.settings = settings
        self.lifecycle = Lifecycle()
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.metrics = metrics = ProxyMetrics(registry, immediate=bool(os.environ.get(METRICS_DIR_ENV)))
        self.pool = pool = static_pool(settings)
        self.discovery_state = DiscoveryState(enabled=settings.etcd is not None)
        self.layout = KeyLayout(prefix=settings.etcd_prefix, cluster=settings.cluster)
        self.tls = server_tls(settings.tls)
        self.node_tls = node_tls = settings.node_tls.context()  # for every connection to https:// nodes
        # Probes and the admin API: a few requests per node and minute.
        connect = settings.timeouts.connect
        self.client = stateless_client(
            timeout=httpx.Timeout(connect, read=30.0), follow_redirects=False, verify=node_tls
        )
        self.http = HttpTransport(connect_timeout=connect, max_connections=settings.max_connections, tls=node_tls)
        # The load scrapes' own connections (one per node): a node busy up to --max-connections is still scraped.
        self.scrapes = HttpTransport(connect_timeout=connect, max_connections=1, tls=node_tls)
        # KV-cache events: a subscriber per publishing node feeds one index, which the kv-aware policy reads.
        kv_index = KvIndex()
        self.kv_subscribers = KvSubscribers(pool, kv_index)
        self.kv_routing = KvRouting(kv_index, self.kv_subscribers.tracked, self.kv_subscribers.active)
        self.policies = self._policies()
        self.elastic = Elastic(self.kv_routing, settings.split_min_prompt_tokens)  # both nodes: local or split
        self.ejector = Ejector(pool, self.client, settings.ejection)
        self.etcd = EtcdClient(settings.etcd) if settings.etcd is not None else None
        key = settings.backend_api_key
        self.backend_auth = {"authorization": f"Bearer {key}"} if key else None
        self.keys = ClientKeys(settings.api_keys)
        # The keys' tenants, their limits and the fair queue.
        self.tenancy = build_tenancy(
            settings, self.keys, registry, pool, self.etcd, self.layout, watching=lambda: self.discovery_state.connected
        )
        # --max-concurrent-requests: HTTP requests and WebSocket sessions take slots of the same limit.
        self.concurrency = ConcurrencyLimit(settings.max_concurrent)
        self.tracer = make_tracer(settings.otlp_traces_endpoint)  # None unless configured: then no span is made
        self.prompt_tokens = PromptTokens(
            dict(settings.tokenizers),
            lambda model: [s.cards[model] for s in pool.serving(model) if model in s.cards],
            registry,
        )
        pool.on_node(self.prompt_tokens.node_seen)
        self.adapters = AdapterRegistry()  # LoRA adapters registered in etcd, loaded where requests need them
        # Claims (one replica does a piece of work for the fleet: a wake, an adapter's load).
        self.claims: Claims = EtcdClaims(self.etcd, self.layout) if self.etcd is not None else LocalClaims()
        me = replica_id()
        self.loader = AdapterLoader(
            pool, self.adapters, self.client, metrics, self.backend_auth, claims=self.claims, me=me
        )
        # vLLM's sleep mode across the fleet.
        self.sleep = build_sleep(
            settings,
            pool,
            self.client,
            self.etcd,
            self.claims,
            registry,
            headers=self.backend_auth,
            base_of=self._base_of,
            me=me,
        )
        self.forwarder = Forwarder(
            transport or self.http, pool, self.policies, settings, metrics, self.ejector, narrow=self.loader.narrow
        )
        self.supervisor = Supervisor(metrics.task_crashes)
        self.hangup = _hangup(self.tenancy.reload, self.tls, metrics, hangups)
        for collector in self.collectors():
            registry.register(collector)

    def _base_of(self, model: str) -> str:
        """The base model of a registered LoRA adapter; any other model is its own."""
        adapter = self.adapters.get(model)
        return adapter.base if adapter is not None else model

    def _policies(self) -> dict[Role, Policy]:
        chosen = dict(self.settings.policies)
        policies: dict[Role, Policy] = {}
        for role in Role:
            name = chosen.get(role.value, DEFAULT_POLICIES[role.value])
            policies[role] = KvAware(self.kv_routing, CacheAware()) if name == KV_AWARE else make_policy(name)
        return policies

    def collectors(self) -> list[Collector]:
        """What /metrics reads from the live objects at scrape time."""
        collectors: list[Collector] = [
            PoolCollector(self.pool, self.discovery_state),
            NodeCollector(self.pool),
            KvCollector(self.kv_subscribers, self.kv_routing),
            ElasticCollector(self.pool, self.elastic),
        ]
        if self.tenancy.tenancy is not None:
            collectors.append(ShareCollector(self.tenancy.tenancy))
        return collectors

    # -- the request path ---------------------------------------------------------------------------------------

    def _counts_uncached(self, settings: ProxySettings) -> Callable[[str], bool]:
        """Whether a model's requests need their uncached part counted: with ``--pd-min-prompt-tokens`` for
        every model, with ``--split-min-prompt-tokens`` for a model that has both nodes now (else not at all)."""
        if settings.pd_min_prompt_tokens > 0:
            return lambda model: True
        if settings.split_min_prompt_tokens <= 0:
            return lambda model: False
        pool = self.pool
        return lambda model: pool.serves(Role.BOTH, model)

    def request_path(self) -> Handler:
        """The layers a proxied request goes through (serving/layers.py), outermost first; the optional ones only
        when configured."""
        settings, metrics = self.settings, self.metrics
        flows = Flows(
            self.pool,
            self.forwarder,
            self.loader,
            self.kv_routing,
            first_byte_timeout=settings.timeouts.first_byte,
            prefill_timeout=settings.timeouts.prefill,
            pd_min_prompt_tokens=settings.pd_min_prompt_tokens,
            elastic=self.elastic,
            session=SessionFlow(self.pool, self.forwarder, metrics, settings, self.node_tls),
        )
        sessions = SessionRelay(flows.session, metrics)
        path: Handler = Answer(Relay(metrics, flows, settings.max_resumes), sessions)
        tenancy = self.tenancy.tenancy
        if tenancy is not None:
            path = Admission(path, tenancy)
        path = PickFlow(path, flows)
        if self.sleep.on_demand is not None:
            path = Wake(path, self.sleep.on_demand)
        path = ReadRequest(
            path,
            self.pool.models,
            self.kv_routing,
            self.prompt_tokens.ids,
            BodyLimits(max_bytes=settings.max_body_bytes, timeout=settings.body_timeout),
            affinity=any(p.name in AFFINITY_POLICIES for p in self.policies.values()),
            count_uncached=self._counts_uncached(settings),
            resumes=settings.max_resumes > 0,
        )
        if tenancy is not None:
            path = TenantLimits(path, tenancy)
        if settings.max_concurrent:
            path = Concurrency(path, self.concurrency)
        path = Keys(path, self.keys)
        if self.tracer is not None:
            path = Tracing(path, self.tracer)
        return Accounting(path, metrics)

    def operator_routes(self, scraped: CollectorRegistry) -> list[BaseRoute]:
        """The replica's own routes: health, status, /metrics (from ``scraped``), the admin API, model cards."""
        settings, tenancy = self.settings, self.tenancy.tenancy
        admin = AdminRoutes(
            pool=self.pool,
            client=self.client,
            admin_key=settings.admin_key,
            etcd=self.etcd,
            layout=self.layout,
            models=settings.models,
            metrics=self.metrics,
            allowed=settings.admin_allow,
            backend_auth=self.backend_auth,
        )
        sleep = self.sleep
        return [
            *InfoRoutes(
                pool=self.pool,
                discovery=self.discovery_state,
                registry=scraped,
                lifecycle=self.lifecycle,
                kv_view=KvView(self.kv_subscribers, self.kv_routing),
                kv_catching_up=self.kv_subscribers.catching_up,
                replicas=functools.partial(replicas_view, tenancy) if tenancy is not None else None,
            ).routes(),
            *admin.routes(),
            *NodeOpsRoutes(self.pool, sleep.calls, sleep.sleeper, sleep.waker, admin.authorize).routes(),
            *ModelRoutes(self.pool, self.keys, self.adapters).routes(),
            *DashboardRoutes().routes(),
        ]

    # -- what runs beside it ------------------------------------------------------------------------------------

    def _start_background(self) -> None:
        settings, pool, supervise = self.settings, self.pool, self.supervisor.start
        prober = ModelProber(
            pool, self.client, settings.models_refresh, self.backend_auth, rate=settings.models_probe_rate
        )
        supervise("model-prober", prober.run)
        supervise("ejection-prober", self.ejector.run)
        supervise("connection-pruner", self._prune_connections)
        supervise("loop-lag", self.metrics.watch_loop_lag)
        if settings.scrape_load > 0:
            watcher = LoadWatcher(
                pool, self.scrapes, settings.scrape_load, self.backend_auth, rate=settings.scrape_rate
            )
            supervise("load-watcher", watcher.run)
        if self.etcd is not None:
            sinks = {ADAPTERS: self.adapters, **self.tenancy.sinks}
            if isinstance(self.claims, EtcdClaims):
                sinks[CLAIMS] = self.claims
            discovery = Discovery(self.etcd, self.layout, pool.apply_all, self.discovery_state, sinks=sinks)
            supervise("etcd-discovery", discovery.run)
        for run in self.tenancy.tasks:
            supervise("tenancy", run)
        for run in self.sleep.tasks:
            supervise("idle-sleeper", run)
        if self.hangup.configured:
            supervise("sighup", self.hangup.run)

    async def _prune_connections(self) -> None:
        """Close, now and then, the idle connections of nodes that left."""
        while True:
            await asyncio.sleep(CLIENT_PRUNE_INTERVAL)
            live = {s.node.url for s in self.pool.all()}
            self.http.prune(live)
            self.scrapes.prune(live)

    def _not_ready(self) -> str | None:
        return not_ready_reason(self.lifecycle, self.discovery_state, self.pool, self.kv_subscribers.catching_up())

    @contextlib.asynccontextmanager
    async def lifespan(self, wait_ready: float) -> AsyncIterator[None]:
        """Run the background work while the app serves; with ``wait_ready``, start serving only once ready (or
        after that many seconds)."""
        self.http.prepare_tls()
        self.kv_subscribers.start()
        self.prompt_tokens.start()
        if self.tracer is not None:
            self.tracer.start()
        self._start_background()
        deadline = time.monotonic() + wait_ready
        while time.monotonic() < deadline and not self.lifecycle.shutting_down and self._not_ready() is not None:
            await asyncio.sleep(0.05)
        try:
            yield
        finally:
            await self._stop()

    async def _stop(self) -> None:
        self.loader.close()
        if self.sleep.on_demand is not None:
            self.sleep.on_demand.close()
        await self.supervisor.stop()
        await self.kv_subscribers.stop()
        if self.etcd is not None:
            await self.etcd.close()
        await self.client.aclose()
        self.prompt_tokens.close()
        self.http.close()
        self.scrapes.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)


def build_app(
    settings: ProxySettings,
    transport: Transport | None = None,
    *,
    wait_ready: float = 0.0,
    hangups: StartHangups | None = None,
) -> ProxyApp:
    """The ASGI app of one replica; ``transport`` carries requests to the nodes (tests pass their own).

    With ``wait_ready`` the app's startup waits up to that many seconds for the replica to be ready (pools
    synced, a node routable), so that the server only listens then: a worker restarted beside others takes no
    connection it would answer with 404 or 503. ``hangups``: the SIGHUPs caught while starting (hangup.py).
    """
    replica = Replica(settings, transport, hangups)
    scraped = replica.registry
    if os.environ.get(METRICS_DIR_ENV):
        # One of several workers (workers.py): counters and histograms summed over all of them, pool gauges ours.
        scraped = CollectorRegistry(auto_describe=True)
        MultiProcessCollector(scraped)  # type: ignore[no-untyped-call]
        for collector in replica.collectors():
            scraped.register(collector)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with replica.lifespan(wait_ready):
            yield

    operator_app = Starlette(
        routes=replica.operator_routes(scraped),
        lifespan=lifespan,
        exception_handlers={ProxyError: _proxy_error, HTTPException: _http_error},
    )
    openai = OpenAIRoutes(
        replica.request_path(),
        operator_app,
        session_header=settings.affinity_header,
        backend_api_key=settings.backend_api_key,
    )
    header_limit = HeaderLimit(openai, max_bytes=settings.max_header_bytes)
    return ProxyApp(header_limit, replica.lifecycle, replica.prompt_tokens, replica.tls)
