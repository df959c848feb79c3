"""The OpenAI-compatible routes: parse just enough of the body to route by model, then hand over.

Completions and chat completions use the disaggregated flow when the model has prefill and decode nodes,
else mixed nodes (then decode nodes on their own). Other /v1/* POST routes, /tokenize and /detokenize go
to a node serving the model (mixed, then decode). The body of a non-disaggregated request is forwarded
byte for byte, so every vLLM feature keeps working.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.disagg import Disaggregator
from proxy.errors import ModelNotFound, NoNodeAvailable
from proxy.forwarder import ErrorAnswer, Forwarder, Leg, Upstream, upstream_headers
from proxy.guard import ClientKeys, ConcurrencyLimit
from proxy.metrics import ProxyMetrics
from proxy.parsing import BodyLimits, affinity_key, check_fields, parse_object, read_body, request_id_of
from proxy.pool import Pool
from proxy.records import Role
from proxy.relay import Exchange, RelayResponse
from proxy.settings import ProxySettings

KNOWN_ROUTES = frozenset(
    ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/score", "/v1/rerank", "/v1/responses",
     "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/pooling", "/v1/classify", "/tokenize", "/detokenize"]
)  # fmt: skip
"""Routes named as such in metrics; any other forwarded path counts as /v1/other."""


class OpenAIRoutes:
    """Endpoints of the OpenAI API; each returns a RelayResponse that does the I/O."""

    def __init__(
        self,
        settings: ProxySettings,
        pool: Pool,
        forwarder: Forwarder,
        metrics: ProxyMetrics,
        limit: ConcurrencyLimit,
        *,
        affinity: bool = False,
    ) -> None:
        self._affinity = affinity
        self._settings = settings
        self._keys = ClientKeys(settings.api_keys)
        self._limit = limit
        self._pool = pool
        self._forwarder = forwarder
        self._disagg = Disaggregator(forwarder, settings.timeouts)
        self._metrics = metrics
        self._limits = BodyLimits(max_bytes=settings.max_body_bytes, timeout=settings.body_timeout)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.generate, methods=["POST"]),
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/tokenize", self.passthrough, methods=["POST"]),
            Route("/detokenize", self.passthrough, methods=["POST"]),
            Route("/v1/{rest:path}", self.passthrough, methods=["POST"]),
        ]

    def _check_routable(self, model: str, roles: tuple[Role, ...]) -> None:
        """503 when the model is served but nothing of ``roles`` is routable now; 404 when nobody serves it."""
        if any(self._pool.candidates(r, model) for r in roles):
            return
        if any(model in s.models for s in self._pool.all()):
            raise NoNodeAvailable(f"no node is available for model {model!r} right now; retry shortly")
        known = ", ".join(self._pool.models()) or "none"
        raise ModelNotFound(f"The model `{model}` does not exist. Known models: {known}.", param="model")

    async def generate(self, request: Request) -> Response:
        return await self._handle(request, disaggregate=True)

    async def passthrough(self, request: Request) -> Response:
        return await self._handle(request, disaggregate=False)

    async def _handle(self, request: Request, *, disaggregate: bool) -> Response:
        """Parse, pick the flow (disaggregated, else one leg to mixed then decode nodes) and hand over."""
        self._keys.check(request)
        raw = await read_body(request, self._limits)
        body = parse_object(raw)
        path = request.url.path
        model = check_fields(body, path)
        request_id = request_id_of(request)
        headers = upstream_headers(request.headers, request_id, self._settings.backend_api_key)
        key = self._affinity_key(request, body)
        route = path if path in KNOWN_ROUTES else "/v1/other"  # bounded metric labels
        pool = self._pool
        if disaggregate and pool.candidates(Role.PREFILL, model) and pool.candidates(Role.DECODE, model):

            async def disagg() -> Upstream | ErrorAnswer:
                return await self._disagg.run(path=path, model=model, body=body, headers=headers, affinity=key)

            return self._relay(disagg, route, "disagg", request_id)
        roles = (Role.MIXED, Role.DECODE)
        self._check_routable(model, roles)
        # Not disaggregated: the body goes to the node byte for byte.
        leg = Leg(roles=roles, model=model, path=path, body=raw, headers=headers,
                  timeout=self._settings.timeouts.first_byte, affinity=key)  # fmt: skip

        async def one_leg() -> Upstream | ErrorAnswer:
            return await self._forwarder.open(leg)

        return self._relay(one_leg, route, "mixed", request_id)

    def _affinity_key(self, request: Request, body: dict[str, Any]) -> str | None:
        if not self._affinity:
            return None
        return affinity_key(body, request.headers.get(self._settings.affinity_header))

    def _relay(self, exchange: Exchange, route: str, mode: str, request_id: str) -> RelayResponse:
        self._limit.acquire()
        return RelayResponse(
            exchange, route=route, mode=mode, request_id=request_id, metrics=self._metrics,
            on_done=self._limit.release,
        )  # fmt: skip

    async def list_models(self, request: Request) -> Response:
        self._keys.check(request)
        now = int(time.time())
        data = [{"id": m, "object": "model", "created": now, "owned_by": "vllm"} for m in self._pool.models()]
        return JSONResponse({"object": "list", "data": data})
