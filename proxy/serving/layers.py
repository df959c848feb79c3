"""The layers a proxied request goes through, outermost first, each wrapping the next as starlette's middleware
wraps an app (``Handler``: one async call with the request):

``Accounting`` (metrics, and any error no layer answered) -> ``Tracing`` (only when a tracer is configured) ->
``Keys`` (the client key) -> ``Concurrency`` (``--max-concurrent-requests``, only when set) -> ``TenantLimits``
(the tenant's limits, with tenants or the fair queue) -> ``ReadRequest`` (the body, the model, routing hints) ->
``Wake`` (only with --wake-on-demand) -> ``PickFlow`` -> ``Admission`` (the body's token estimate and the fair
queue, with tenants or the queue) -> the relay (relay.py).

The refusals that need no body come first: a replica at its limit or a tenant over its own answers before the
body is read (the server drops what the client still sends). A layer that refuses a request answers it itself
(``ProxyRequest.refuse``) and does not call the next one, so every layer outside it sees the status the client
got when it finishes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from vllm_etcd_proxy.proxy.errors import ClientLeft, NodeAdminRefused, NoNodeAvailable, ProxyError
from vllm_etcd_proxy.proxy.kvcache.prompt.ids import PromptIds, read_prompt
from vllm_etcd_proxy.proxy.routing.affinity import PrefixIndex, route_hints
from vllm_etcd_proxy.proxy.routing.kv_aware import KvRouting
from vllm_etcd_proxy.proxy.serving.flows import Flows
from vllm_etcd_proxy.proxy.serving.forms import request_model
from vllm_etcd_proxy.proxy.serving.forwarder import header_lines
from vllm_etcd_proxy.proxy.serving.guard import ClientKeys, ConcurrencyLimit
from vllm_etcd_proxy.proxy.serving.parsing import BodyLimits, read_body
from vllm_etcd_proxy.proxy.serving.request import ProxyRequest, Tally
from vllm_etcd_proxy.proxy.serving.resume import not_resumable
from vllm_etcd_proxy.proxy.serving.routes import Kind
from vllm_etcd_proxy.proxy.serving.sessions import SessionRelay, query_model
from vllm_etcd_proxy.proxy.sleep.ondemand import WakeOnDemand
from vllm_etcd_proxy.proxy.telemetry.metrics import ProxyMetrics
from vllm_etcd_proxy.proxy.telemetry.spans import Tracer, split_trace_headers
from vllm_etcd_proxy.proxy.tenancy.admission import Tenancy
from vllm_etcd_proxy.proxy.tenancy.keys import Limits

Handler = Callable[[ProxyRequest], Awaitable[None]]


class Accounting:
    """The request's metrics once it is answered, per route and per model; answers a ``ProxyError`` no layer
    inside did (none should)."""

    def __init__(self, app: Handler, metrics: ProxyMetrics) -> None:
        self.app, self._metrics = app, metrics

    async def __call__(self, request: ProxyRequest) -> None:
        try:
            await self.app(request)
        except ProxyError as exc:
            await request.refuse(exc)
        finally:
            self._count(request)

    def _count(self, request: ProxyRequest) -> None:
        metrics = self._metrics
        if request.kind is Kind.SESSION:
            if request.denied is not None:  # an accepted session is counted by its relay
                metrics.websocket_done(request.route, request.denied.outcome)
            return
        if isinstance(request.error, ClientLeft):
            metrics.client_disconnects.inc()
        metrics.request_done(request.route, request.mode, request.status, request.started)
        tally, model = request.tally, request.model
        if tally is not None and request.status == 200 and model is not None:
            prompt, completion = request.usage()
            metrics.generated(model, request.started, tally.first_at, tally.streamed, tally.chunks, prompt, completion)


class Tracing:
    """The request's span: the client's trace context taken out of what the nodes get, each leg a child span."""

    def __init__(self, app: Handler, tracer: Tracer) -> None:
        self.app, self._tracer = app, tracer

    async def __call__(self, request: ProxyRequest) -> None:
        request.forwarded, parent = split_trace_headers(request.forwarded)
        trace = request.trace = self._tracer.request(
            method=request.scope.get("method", "GET"),  # a WebSocket's handshake is a GET
            route=request.route,
            request_id=request.request_id,
            started=request.started,
            parent=parent,
        )
        try:
            await self.app(request)
        except ProxyError as exc:
            await request.refuse(exc)
        finally:
            trace.usage(*request.usage())
            trace.end(request.status, request.model)


class Keys:
    """The client key (``Authorization: Bearer``): 401 without a valid one when keys are configured; its limits
    go on the request."""

    def __init__(self, app: Handler, keys: ClientKeys) -> None:
        self.app, self._keys = app, keys

    async def __call__(self, request: ProxyRequest) -> None:
        try:
            request.limits = self._keys.check(request.client.authorization)
        except ProxyError as exc:
            await request.refuse(exc)
            return
        await self.app(request)


class ReadRequest:
    """The body (within its limits), the model it names, what the nodes get, and what routing reads of it."""

    def __init__(
        self,
        app: Handler,
        served: Callable[[], list[str]],
        kv: KvRouting,
        prompt_ids: PromptIds,
        limits: BodyLimits,
        *,
        affinity: bool,
        count_uncached: Callable[[str], bool],
        resumes: bool,
    ) -> None:
        """``count_uncached(model)``: whether a flow may ask for the model's requests' uncached part (a prefill
        leg or a split that only pays with enough of it); else a request's prompt is read only for the affinity
        key, and not at all when no policy uses one or the request names its conversation."""
        self.app, self._served, self._kv, self._prompt_ids, self._limits = app, served, kv, prompt_ids, limits
        self._prefixes = PrefixIndex()
        self._affinity, self._count_uncached, self._resumes = affinity, count_uncached, resumes

    async def __call__(self, request: ProxyRequest) -> None:
        try:
            await self._read(request)
        except ProxyError as exc:
            await request.refuse(exc)
            return
        await self.app(request)

    async def _read(self, request: ProxyRequest) -> None:
        scope, path, kind = request.scope, request.path, request.kind
        if kind is Kind.NODE_ADMIN:
            raise NodeAdminRefused(
                f"{path} is a vLLM node-admin route: it acts on one node's engine, so the proxy never sends it "
                "to a node picked by load balancing; send it to that node directly"
            )
        query: bytes = scope.get("query_string", b"")
        target: bytes = scope["raw_path"] if scope.get("raw_path") else path.encode()
        request.target = target + b"?" + query if query else target
        if kind is Kind.SESSION:
            request.model = query_model(request) or self._first_model()
            return
        request.raw = await read_body(request.receive, request.client.content_length, self._limits)
        request.head = header_lines(request.forwarded)
        request.method = scope["method"].encode()
        if kind is not Kind.BY_RESPONSE_ID:
            request.body, request.model = request_model(request.client, request.raw, query, kind, path, self._served)
            self._for_routing(request)

    def _first_model(self) -> str:
        """vLLM's rule for a session that names no model, within what the fleet serves."""
        models = self._served()
        if not models:
            raise NoNodeAvailable("no node serves any model right now; retry shortly")
        return models[0]

    def _for_routing(self, request: ProxyRequest) -> None:
        body, model = request.body, request.model
        if body is None or model is None:
            return
        count = self._count_uncached(model)
        if self._affinity or count:
            hints = route_hints(self._prefixes, body, request.client.session, count_uncached=count)
            request.affinity = hints.key if self._affinity else None
            request.uncached_tokens = hints.uncached_tokens
        if self._kv.active():
            request.prompt = read_prompt(self._prompt_ids, model, request.path, body)
        if request.kind is Kind.GENERATE:
            request.tally = Tally()
            request.resumable = self._resumes and not_resumable(request.path, body) is None


class Wake:
    """A model with no node awake but some asleep: the request waits while one is woken (sleep/ondemand.py);
    503 when none wakes in time."""

    def __init__(self, app: Handler, on_demand: WakeOnDemand) -> None:
        self.app, self._on_demand = app, on_demand

    async def __call__(self, request: ProxyRequest) -> None:
        try:
            await self._on_demand.ready(request.model, request.receive)
        except ProxyError as exc:
            await request.refuse(exc)
            return
        await self.app(request)


class PickFlow:
    """Which flow runs the request (flows.py); 404 or 503 when no node can serve its model."""

    def __init__(self, app: Handler, flows: Flows) -> None:
        self.app, self._flows = app, flows

    async def __call__(self, request: ProxyRequest) -> None:
        try:
            flow = request.flow = self._flows.pick(request)
        except ProxyError as exc:
            await request.refuse(exc)
            return
        request.mode = flow.mode
        await self.app(request)


class TenantLimits:
    """The tenant's limits (tenancy/), before the body is read: admitted, refused (429), or held while another
    replica hands capacity over; the tenant is charged what the answer cost once it is through (``Ticket``)."""

    def __init__(self, app: Handler, tenancy: Tenancy) -> None:
        self.app, self._tenancy = app, tenancy

    async def __call__(self, request: ProxyRequest) -> None:
        tenancy, limits = self._tenancy, request.limits
        if request.kind is Kind.SESSION:  # a session holds one of its tenant's concurrency slots, and no rate
            limits = Limits(tenant=limits.tenant, concurrency=limits.concurrency) if limits is not None else None
            if limits is None or not limits.concurrency:
                await self.app(request)
                return
        elif limits is None and tenancy.queue is None:
            await self.app(request)
            return
        try:
            ticket = await tenancy.admit_limits(limits, request.client.content_length)
        except ProxyError as exc:
            await request.refuse(exc)
            return
        request.ticket, request.send = ticket, ticket.wrap(request.send)
        try:
            await self.app(request)
        except ProxyError as exc:
            await request.refuse(exc)
        finally:
            ticket.finish(request.status, *request.usage(), request.tally)


class Admission:
    """Once the body is read and a flow picked: the tenant's tokens estimated from the body, and the fair queue
    (tenancy/queue.py) while every node of the model is full (503 past ``--queue-timeout``)."""

    def __init__(self, app: Handler, tenancy: Tenancy) -> None:
        self.app, self._tenancy = app, tenancy

    async def __call__(self, request: ProxyRequest) -> None:
        ticket = request.ticket
        if ticket is not None and request.kind is Kind.SESSION:
            ticket.routed()  # a session is not queued: it holds a node as long as it lasts
        elif ticket is not None:
            try:
                await self._tenancy.queue_turn(ticket, request.model, request.body, len(request.raw), request.receive)
            except ProxyError as exc:
                await request.refuse(exc)
                return
        await self.app(request)


class Concurrency:
    """At most ``--max-concurrent-requests`` proxied requests in flight on this replica (503 past it)."""

    def __init__(self, app: Handler, limit: ConcurrencyLimit) -> None:
        self.app, self._limit = app, limit

    async def __call__(self, request: ProxyRequest) -> None:
        limit = self._limit
        try:
            limit.acquire()
        except ProxyError as exc:
            await request.refuse(exc)
            return
        try:
            await self.app(request)
        finally:
            limit.release()


class Answer:
    """The end of the path: the HTTP relay for a request, the session relay for a WebSocket session."""

    def __init__(self, relay: Handler, sessions: SessionRelay) -> None:
        self._relay, self._sessions = relay, sessions

    async def __call__(self, request: ProxyRequest) -> None:
        if request.kind is Kind.SESSION:
            await self._sessions(request)
        else:
            await self._relay(request)
