"""The OpenAI-compatible routes, as raw ASGI: parse just enough of the body to route by model, then hand over.

``POST /v1/*``, ``/tokenize`` and ``/detokenize`` are handled here with no framework objects per request;
everything else (``GET /v1/models`` and the operator routes) goes on to the starlette app.

Completions and chat completions use the disaggregated flow when the model has prefill and decode nodes,
else mixed nodes (then decode nodes on their own). Other routes go to a node serving the model (mixed, then
decode). The body of a non-disaggregated request is forwarded byte for byte, so every vLLM feature keeps
working.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import ModelNotFound, NoNodeAvailable, ProxyError
from vllm_etcd_proxy.proxy.operations.metrics import ProxyMetrics
from vllm_etcd_proxy.proxy.routing.affinity import Hints, PrefixIndex, route_hints
from vllm_etcd_proxy.proxy.serving.disagg import Disaggregator
from vllm_etcd_proxy.proxy.serving.forwarder import ErrorAnswer, Forwarder, Leg, Upstream, header_lines
from vllm_etcd_proxy.proxy.serving.guard import ClientKeys, ConcurrencyLimit
from vllm_etcd_proxy.proxy.serving.parsing import BodyLimits, check_fields, parse_object, read_body, read_headers
from vllm_etcd_proxy.proxy.serving.relay import Exchange, Relay, ResumePlan, send_error
from vllm_etcd_proxy.proxy.serving.resume import not_resumable
from vllm_etcd_proxy.proxy.serving.websocket import WebSocketProxy
from vllm_etcd_proxy.proxy.settings import ProxySettings

KNOWN_ROUTES = frozenset(
    ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/score", "/v1/rerank", "/v1/responses",
     "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/pooling", "/v1/classify", "/tokenize", "/detokenize"]
)  # fmt: skip
"""Routes named as such in metrics; any other forwarded path counts as /v1/other."""
GENERATE_ROUTES = frozenset(["/v1/completions", "/v1/chat/completions"])
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
        websockets: WebSocketProxy,
        affinity: bool = False,
    ) -> None:
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
        self._websockets = websockets
        self._limits = BodyLimits(max_bytes=settings.max_body_bytes, timeout=settings.body_timeout)
        self._session_header = settings.affinity_header.encode("latin-1")
        key = settings.backend_api_key
        self._backend_auth = f"Bearer {key}".encode("latin-1") if key else None
        self._first_byte_timeout = settings.timeouts.first_byte
        self._max_resumes = settings.max_resumes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            if path.startswith("/v1/") or path == "/tokenize" or path == "/detokenize":
                await self._handle(scope, receive, send, path)
                return
        elif scope["type"] == "websocket":
            await self._websockets(scope, receive, send)
            return
        await self._fallback(scope, receive, send)

    def _check_routable(self, model: str, roles: tuple[Role, ...]) -> None:
        """503 when the model is served but nothing of ``roles`` is routable now; 404 when nobody serves it."""
        if any(self._pool.candidates(r, model) for r in roles):
            return
        if any(model in s.models for s in self._pool.all()):
            raise NoNodeAvailable(f"no node is available for model {model!r} right now; retry shortly")
        known = ", ".join(self._pool.models()) or "none"
        raise ModelNotFound(f"The model `{model}` does not exist. Known models: {known}.", param="model")

    async def _handle(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """Parse, pick the flow (disaggregated, else one leg to mixed then decode nodes) and hand over."""
        started = time.monotonic()
        route = path if path in KNOWN_ROUTES else "/v1/other"  # bounded metric labels
        client = read_headers(scope, session_header=self._session_header, backend_auth=self._backend_auth)
        mode = "none"
        plan: ResumePlan | None = None
        try:
            self._keys.check(client.authorization)
            raw = await read_body(receive, client.content_length, self._limits)
            body = parse_object(raw)
            model = check_fields(body, path)
            query = scope.get("query_string", b"")
            target = scope["raw_path"] if scope.get("raw_path") else path.encode()
            if query:
                target += b"?" + query
            hints = (route_hints(self._prefixes, body, client.session, count_uncached=self._pd_min_prompt_tokens > 0)
                     if self._read_prompts else _NO_HINTS)  # fmt: skip
            request = _Request(path=path, target=target, model=model, head=header_lines(client.forwarded),
                               affinity=hints.key if self._affinity else None,
                               uncached_tokens=hints.uncached_tokens)  # fmt: skip
            mode, exchange = self._exchange(request, raw, body)
            if self._max_resumes and not_resumable(path, body) is None:

                async def reopen(continuation: dict[str, Any], avoid: tuple[NodeState, ...]) -> Upstream | ErrorAnswer:
                    _, again = self._exchange(request, orjson.dumps(continuation), continuation, avoid)
                    return await again()

                plan = ResumePlan(path=path, body=body, reopen=reopen, max_resumes=self._max_resumes)
            self._limit.acquire()
        except ProxyError as exc:
            await send_error(send, exc, client.request_id)
            self._metrics.request_done(route, mode, exc.status, started)
            return
        status = 499
        try:
            status = await self._relay(exchange, receive, send, route=route, mode=mode,
                                       request_id=client.request_id, started=started, plan=plan)  # fmt: skip
        finally:
            self._limit.release()
            self._metrics.request_done(route, mode, status, started)

    def _exchange(self, request: _Request, raw: bytes, body: dict[str, Any],
                  avoid: tuple[NodeState, ...] = ()) -> tuple[str, Exchange]:  # fmt: skip
        """The flow for this request and body: ("disagg" or "mixed", what runs it)."""
        pool, model, head = self._pool, request.model, request.head
        if request.path in GENERATE_ROUTES and pool.candidates(Role.PREFILL, model) and \
                pool.candidates(Role.DECODE, model):  # fmt: skip
            uncached = request.uncached_tokens
            if uncached is not None and uncached < self._pd_min_prompt_tokens:
                # So little of the prompt is new that a prefill leg costs more than it saves.
                return "decode", self._one_leg(request, raw, (Role.DECODE, Role.MIXED), avoid)
            disagg = self._disagg

            async def disaggregated() -> Upstream | ErrorAnswer:
                return await disagg.run(path=request.target, model=model, raw=raw, body=body, head=head,
                                        affinity=request.affinity, avoid=avoid)  # fmt: skip

            return "disagg", disaggregated
        self._check_routable(model, _MIXED_ROLES)
        return "mixed", self._one_leg(request, raw, _MIXED_ROLES, avoid)

    def _one_leg(self, request: _Request, raw: bytes, roles: tuple[Role, ...],
                 avoid: tuple[NodeState, ...]) -> Exchange:  # fmt: skip
        # Not disaggregated: the body goes to the node byte for byte.
        leg = Leg(roles=roles, model=request.model, path=request.target, head=request.head, body=raw,
                  timeout=self._first_byte_timeout, affinity=request.affinity)  # fmt: skip
        forwarder = self._forwarder

        async def one_leg() -> Upstream | ErrorAnswer:
            return await forwarder.open(leg, avoid)

        return one_leg


class _Request(NamedTuple):
    """What a request's legs (and any continuation's) share."""

    path: str
    target: bytes
    """Path and query for the nodes."""
    model: str
    head: bytes
    affinity: str | None
    uncached_tokens: int | None
