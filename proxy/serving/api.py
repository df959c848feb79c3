"""vLLM's API, as raw ASGI: parse just enough of the request to route it, then hand over.

Every path that is not the replica's own (``routes.py``) is forwarded, any method, with no framework objects per
request; the replica's own routes (``GET /v1/models``, health, status, the admin API) go on to the starlette app,
and WebSocket connections to ``websockets``.

Completions and chat completions use the disaggregated flow when the model has prefill and decode nodes, else
mixed nodes (then decode nodes on their own). ``POST /v1/responses`` goes where its ``previous_response_id`` is
kept, and every by-id Responses route to the node holding that id (``responses.py``). Any other route goes to a
node serving the request's model: from the JSON body, a multipart or urlencoded form field, the query string, or
else the first model the fleet serves (vLLM's rule for a request that names none). Bodies are forwarded byte for
byte (a new response's body gains only its ``request_id``), so every vLLM feature keeps working.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_etcd_proxy.fleet.adapters import Adapter
from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import ClientLeft, ModelNotFound, NodeAdminRefused, NoNodeAvailable, ProxyError
from vllm_etcd_proxy.proxy.operations.metrics import ProxyMetrics
from vllm_etcd_proxy.proxy.routing.affinity import Hints, PrefixIndex, route_hints
from vllm_etcd_proxy.proxy.routing.kvchoice import KvRouting
from vllm_etcd_proxy.proxy.routing.kvroute import KvPrompt, PromptIds, read_prompt, token_id_prompt
from vllm_etcd_proxy.proxy.serving.adapters import AdapterLoader, with_adapter
from vllm_etcd_proxy.proxy.serving.disagg import Disaggregator
from vllm_etcd_proxy.proxy.serving.forms import request_model
from vllm_etcd_proxy.proxy.serving.forwarder import ErrorAnswer, Forwarder, Leg, Upstream, header_lines
from vllm_etcd_proxy.proxy.serving.guard import ClientKeys, ConcurrencyLimit
from vllm_etcd_proxy.proxy.serving.parsing import BodyLimits, read_body, read_headers
from vllm_etcd_proxy.proxy.serving.relay import Exchange, Relay, ResumePlan, Tally, send_error
from vllm_etcd_proxy.proxy.serving.responses import ResponseIds, previous_response_id
from vllm_etcd_proxy.proxy.serving.resume import not_resumable
from vllm_etcd_proxy.proxy.serving.routes import Kind, classify, metric_route, response_id_of
from vllm_etcd_proxy.proxy.serving.usage import usage_of
from vllm_etcd_proxy.proxy.settings import ProxySettings
from vllm_etcd_proxy.proxy.tenancy.admission import Tenancy, Ticket
from vllm_etcd_proxy.proxy.tracing.spans import RequestTrace, Tracer, split_trace_headers

FORWARDED_METHODS = frozenset(["GET", "POST", "PUT", "PATCH", "DELETE"])
_MIXED_ROLES = (Role.MIXED, Role.DECODE)
_NO_HINTS = Hints(key=None, uncached_tokens=None)


class OpenAIRoutes:
    """ASGI app: the OpenAI POST routes, and ``fallback`` for every other request."""

    def __init__(
        self,
        settings: ProxySettings,
        pool: Pool,
        forwarder: Forwarder,
        metrics: ProxyMetrics,
        limit: ConcurrencyLimit,
        fallback: ASGIApp,
        *,
        keys: ClientKeys,
        affinity: bool = False,
        websockets: ASGIApp | None = None,
        tracer: Tracer | None = None,
        adapters: AdapterLoader | None = None,
        tenancy: Tenancy | None = None,
        kv: KvRouting | None = None,
        prompt_ids: PromptIds = token_id_prompt,
    ) -> None:
        self._tracer, self._adapters, self._tenancy = tracer, adapters, tenancy
        self._kv, self._prompt_ids = kv, prompt_ids
        self._websockets = websockets
        self._ids = ResponseIds(pool)
        self._affinity = affinity
        self._pd_min_prompt_tokens = settings.pd_min_prompt_tokens
        self._read_prompts = affinity or settings.pd_min_prompt_tokens > 0
        self._prefixes = PrefixIndex()
        self._settings = settings
        self._keys = keys
        self._limit = limit
        self._pool = pool
        self._forwarder = forwarder
        self._disagg = Disaggregator(forwarder, settings.timeouts)
        self._metrics = metrics
        self._relay = Relay(metrics)
        self._fallback = fallback
        self._limits = BodyLimits(max_bytes=settings.max_body_bytes, timeout=settings.body_timeout)
        self._session_header = settings.affinity_header.encode("latin-1")
        key = settings.backend_api_key
        self._backend_auth = f"Bearer {key}".encode("latin-1") if key else None
        self._first_byte_timeout = settings.timeouts.first_byte
        self._max_resumes = settings.max_resumes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            kind = classify(path)
            if kind is not Kind.OWN and scope["method"] in FORWARDED_METHODS:
                await self._handle(scope, receive, send, path, kind)
                return
        elif scope["type"] == "websocket" and self._websockets is not None:
            await self._websockets(scope, receive, send)
            return
        await self._fallback(scope, receive, send)

    def _check_routable(self, model: str, roles: tuple[Role, ...]) -> None:
        """503 when the model is served but nothing of ``roles`` is routable now; 404 when nobody serves it."""
        if any(self._pool.candidates(r, model) for r in roles):
            return
        if any(model in s.models for s in self._pool.all()):
            raise NoNodeAvailable(f"no node is available for model {model!r} right now; retry shortly")
        served = self._pool.models()
        if self._adapters is not None:  # registered LoRA adapters are known models too (issue 19)
            served = sorted({*served, *(a.name for a in self._adapters.listed(served))})
        known = ", ".join(served) or "none"
        raise ModelNotFound(f"The model `{model}` does not exist. Known models: {known}.", param="model")

    async def _handle(self, scope: Scope, receive: Receive, send: Send, path: str, kind: Kind) -> None:
        """Parse, pick the flow and hand over to the relay."""
        started = time.monotonic()
        route = metric_route(path, kind)
        client = read_headers(scope, session_header=self._session_header, backend_auth=self._backend_auth)
        mode = "none"
        plan: ResumePlan | None = None
        forwarded, model, tally, trace, body = client.forwarded, None, None, None, None
        ticket: Ticket | None = None
        if self._tracer is not None:
            forwarded, parent = split_trace_headers(forwarded)
            trace = self._tracer.request(
                method=scope["method"], route=route, request_id=client.request_id, started=started, parent=parent
            )
        try:
            limits = self._keys.check(client.authorization)
            if kind is Kind.NODE_ADMIN:
                raise NodeAdminRefused(
                    f"{path} is a vLLM node-admin route: it acts on one node's engine, so the proxy never sends it "
                    "to a node picked by load balancing; send it to that node directly"
                )
            raw = await read_body(receive, client.content_length, self._limits)
            query = scope.get("query_string", b"")
            target = scope["raw_path"] if scope.get("raw_path") else path.encode()
            if query:
                target += b"?" + query
            head = header_lines(forwarded)
            method = scope["method"].encode()
            if kind is Kind.BY_RESPONSE_ID:
                mode, exchange = "pinned", self._by_response_id(path, target, head, raw, method, trace)
            else:
                body, model = request_model(client, raw, query, kind, path, self._pool.models)
                hints = (
                    route_hints(self._prefixes, body, client.session, count_uncached=self._pd_min_prompt_tokens > 0)
                    if self._read_prompts and body is not None
                    else _NO_HINTS
                )
                prompt = (
                    read_prompt(self._prompt_ids, model, path, body)
                    if self._kv is not None and body is not None and self._kv.active()
                    else None
                )
                request = _Request(
                    path=path,
                    target=target,
                    model=model,
                    head=head,
                    method=method,
                    affinity=hints.key if self._affinity else None,
                    uncached_tokens=hints.uncached_tokens,
                    trace=trace,
                    prompt=prompt,
                )
                if kind is Kind.GENERATE:
                    tally = Tally()
                if kind is Kind.RESPONSES and body is not None:
                    mode, exchange = self._new_response(request, raw, body)
                else:
                    mode, exchange = self._exchange(request, raw, body if kind is Kind.GENERATE else None)
                if (
                    self._max_resumes
                    and kind is Kind.GENERATE
                    and body is not None
                    and not_resumable(path, body) is None
                ):
                    plan = self._resume_plan(request, body)
            if self._tenancy is not None and (limits is not None or self._tenancy.queue is not None):
                ticket, send = await self._tenancy.admit(limits, model, body, len(raw), receive, send)
            self._limit.acquire()
        except ProxyError as exc:
            if ticket is not None:
                ticket.finish(exc.status)
            if isinstance(exc, ClientLeft):
                self._metrics.client_disconnects.inc()
            await send_error(send, exc, client.request_id, route=route)
            self._metrics.request_done(route, mode, exc.status, started)
            if trace is not None:
                trace.end(exc.status, model)
            return
        status = 499
        try:
            status = await self._relay(
                exchange,
                receive,
                send,
                route=route,
                mode=mode,
                request_id=client.request_id,
                started=started,
                plan=plan,
                tally=tally,
            )
        finally:
            self._limit.release()
            self._metrics.request_done(route, mode, status, started)
            if tally is not None or trace is not None or ticket is not None:
                self._done(status, model, started, tally, trace, ticket)

    def _done(
        self,
        status: int,
        model: str | None,
        started: float,
        tally: Tally | None,
        trace: RequestTrace | None,
        ticket: Ticket | None = None,
    ) -> None:
        """Per-model metrics and the request's span, once the answer is through."""
        prompt = completion = None
        if status == 200 and tally is not None and model is not None:
            if tally.tail:
                prompt, completion = usage_of(tally.tail)
            self._metrics.generated(model, started, tally.first_at, tally.streamed, tally.chunks, prompt, completion)
        if ticket is not None:
            ticket.finish(status, prompt, completion, tally)
        if trace is not None:
            trace.usage(prompt, completion)
            trace.end(status, model)

    def _resume_plan(self, request: _Request, body: dict[str, Any]) -> ResumePlan:
        async def reopen(continuation: dict[str, Any], avoid: tuple[NodeState, ...]) -> Upstream | ErrorAnswer:
            if request.trace is not None:
                request.trace.resumed()
            _, again = self._exchange(request, orjson.dumps(continuation), continuation, avoid)
            return await again()

        return ResumePlan(path=request.path, body=body, reopen=reopen, max_resumes=self._max_resumes)

    def _by_response_id(
        self, path: str, target: bytes, head: bytes, raw: bytes, method: bytes, trace: RequestTrace | None
    ) -> Exchange:
        holder = self._ids.holder(response_id_of(path))
        leg = Leg(
            roles=(holder.node.role,),
            model="",
            path=target,
            head=head,
            body=raw,
            timeout=self._first_byte_timeout,
            method=method,
            pinned=holder,
            trace=trace,
        )
        return self._open(leg)

    def _new_response(self, request: _Request, raw: bytes, body: dict[str, Any]) -> tuple[str, Exchange]:
        """A new response: where its previous response is kept, else by model; its id names its node."""
        ids = self._ids
        previous = previous_response_id(body)
        holder = ids.holder(previous) if previous is not None and ids.is_ours(previous) else None
        if holder is None:
            self._check_routable(request.model, _MIXED_ROLES)
        leg = Leg(
            roles=_MIXED_ROLES,
            model=request.model,
            path=request.target,
            head=request.head,
            body=raw,
            timeout=self._first_byte_timeout,
            affinity=request.affinity,
            pinned=holder,
            trace=request.trace,
            prompt=request.prompt,
            body_for=lambda state: ids.new_response_body(raw, body, state),
        )
        return ("pinned" if holder is not None else "mixed"), self._open(leg)

    def _open(self, leg: Leg, avoid: tuple[NodeState, ...] = ()) -> Exchange:
        forwarder = self._forwarder

        async def one_leg() -> Upstream | ErrorAnswer:
            return await forwarder.open(leg, avoid)

        return one_leg

    def _exchange(
        self, request: _Request, raw: bytes, body: dict[str, Any] | None, avoid: tuple[NodeState, ...] = ()
    ) -> tuple[str, Exchange]:
        """The flow for this request: ("disagg", "decode" or "mixed", what runs it). ``body`` is given for the
        generate routes only (the others never take the disaggregated flow)."""
        pool, model, head = self._pool, request.model, request.head
        if body is not None and pool.candidates(Role.PREFILL, model) and pool.candidates(Role.DECODE, model):
            uncached = request.uncached_tokens
            kv, prompt = self._kv, request.prompt
            if kv is not None and prompt is not None and self._pd_min_prompt_tokens:  # the index's exact count
                candidates = [s for r in Role for s in pool.candidates(r, model)]
                uncached = kv.uncached(prompt, candidates, uncached, self._pd_min_prompt_tokens)
            if uncached is not None and uncached < self._pd_min_prompt_tokens:
                # So little of the prompt is new that a prefill leg costs more than it saves.
                return "decode", self._one_leg(request, raw, (Role.DECODE, Role.MIXED), avoid)
            disagg = self._disagg

            async def disaggregated() -> Upstream | ErrorAnswer:
                return await disagg.run(
                    path=request.target,
                    model=model,
                    raw=raw,
                    body=body,
                    head=head,
                    affinity=request.affinity,
                    avoid=avoid,
                    trace=request.trace,
                    prompt=request.prompt,
                )

            return "disagg", disaggregated
        if self._adapters is not None and (adapter := self._adapters.registered(model)) is not None:
            return "mixed", self._adapter_leg(request, raw, adapter, avoid)
        self._check_routable(model, _MIXED_ROLES)
        return "mixed", self._one_leg(request, raw, _MIXED_ROLES, avoid)

    def _adapter_leg(self, request: _Request, raw: bytes, adapter: Adapter, avoid: tuple[NodeState, ...]) -> Exchange:
        """A registered LoRA adapter's request: loaded on a node first when none has it (serving/adapters.py)."""
        assert self._adapters is not None
        loader, one_leg = self._adapters, self._one_leg(request, raw, _MIXED_ROLES, avoid)

        async def adapted() -> Upstream | ErrorAnswer:
            return await with_adapter(loader, adapter, one_leg)

        return adapted

    def _one_leg(
        self, request: _Request, raw: bytes, roles: tuple[Role, ...], avoid: tuple[NodeState, ...]
    ) -> Exchange:
        # Not disaggregated: the body goes to the node byte for byte.
        leg = Leg(
            roles=roles,
            model=request.model,
            path=request.target,
            head=request.head,
            body=raw,
            timeout=self._first_byte_timeout,
            affinity=request.affinity,
            method=request.method,
            trace=request.trace,
            prompt=request.prompt,
            prefer=self._adapters.prefer(request.model) if self._adapters is not None else None,
        )
        return self._open(leg, avoid)


class _Request(NamedTuple):
    """What a request's legs (and any continuation's) share."""

    path: str
    target: bytes
    """Path and query for the nodes."""
    model: str
    head: bytes
    method: bytes
    affinity: str | None
    uncached_tokens: int | None
    trace: RequestTrace | None
    prompt: KvPrompt | None = None  # the token ids for kv-aware (None: unknown, or no node publishes KV events)
