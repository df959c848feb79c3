"""The OpenAI-compatible routes: parse just enough of the body to route by model, then hand over.

Completions and chat completions use the disaggregated flow when the model has prefill and decode nodes,
else mixed nodes (then decode nodes on their own). Other /v1/* POST routes, /tokenize and /detokenize go
to a node serving the model (mixed, then decode). The body of a non-disaggregated request is forwarded
byte for byte, so every vLLM feature keeps working.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.disagg import Disaggregator
from proxy.errors import BadRequest, ModelNotFound, NoNodeAvailable, PayloadTooLarge
from proxy.forwarder import ErrorAnswer, Forwarder, Leg, Upstream, upstream_headers
from proxy.metrics import ProxyMetrics
from proxy.pool import Pool
from proxy.records import Role
from proxy.relay import Exchange, RelayResponse
from proxy.settings import ProxySettings

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
MAX_BODY_BYTES = 32 * 1024 * 1024
"""Largest request body accepted (a 128k-token prompt is ~1 MB of JSON; images inline are bigger)."""


def request_id_of(request: Request) -> str:
    """The client's X-Request-Id when it is sane, else a new one."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else uuid.uuid4().hex


async def read_json_object(request: Request) -> tuple[bytes, dict[str, Any]]:
    """The raw body and its JSON object; 413 past MAX_BODY_BYTES, 400 when it is not a JSON object."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise PayloadTooLarge(f"request body is larger than {MAX_BODY_BYTES} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise PayloadTooLarge(f"request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return bytes(raw), body


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    return model


class OpenAIRoutes:
    """Endpoints of the OpenAI API; each returns a RelayResponse that does the I/O."""

    def __init__(self, settings: ProxySettings, pool: Pool, forwarder: Forwarder, metrics: ProxyMetrics) -> None:
        self._settings = settings
        self._pool = pool
        self._forwarder = forwarder
        self._disagg = Disaggregator(forwarder, settings.timeouts)
        self._metrics = metrics

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.generate, methods=["POST"]),
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/tokenize", self.passthrough, methods=["POST"]),
            Route("/detokenize", self.passthrough, methods=["POST"]),
            Route("/v1/{rest:path}", self.passthrough, methods=["POST"]),
        ]

    def _unknown_model(self, model: str) -> ModelNotFound:
        known = self._pool.models()
        listed = ", ".join(known) if known else "none"
        return ModelNotFound(f"The model `{model}` does not exist. Known models: {listed}.", param="model")

    def _no_node(self, model: str) -> NoNodeAvailable:
        return NoNodeAvailable(f"no node is available for model {model!r} right now; retry shortly")

    def _known(self, model: str) -> bool:
        return any(model in s.models for s in self._pool.all())

    async def generate(self, request: Request) -> Response:
        raw, body = await read_json_object(request)
        model = model_of(body)
        request_id = request_id_of(request)
        headers = upstream_headers(request.headers, request_id)
        path = request.url.path
        pool = self._pool
        if pool.candidates(Role.PREFILL, model) and pool.candidates(Role.DECODE, model):
            mode = "disagg"

            async def exchange() -> Upstream | ErrorAnswer:
                return await self._disagg.run(path=path, model=model, body=body, headers=headers)

        else:
            roles = (Role.MIXED, Role.DECODE)
            if not any(pool.candidates(r, model) for r in roles):
                raise self._no_node(model) if self._known(model) else self._unknown_model(model)
            mode = "mixed"
            leg = Leg(roles=roles, model=model, path=path, body=raw, headers=headers,
                      timeout=self._settings.timeouts.first_byte)  # fmt: skip

            async def exchange() -> Upstream | ErrorAnswer:
                return await self._forwarder.open(leg)

        return self._relay(exchange, path, mode, request_id)

    async def passthrough(self, request: Request) -> Response:
        raw, body = await read_json_object(request)
        model = model_of(body)
        request_id = request_id_of(request)
        roles = (Role.MIXED, Role.DECODE)
        if not any(self._pool.candidates(r, model) for r in roles):
            raise self._no_node(model) if self._known(model) else self._unknown_model(model)
        leg = Leg(roles=roles, model=model, path=request.url.path, body=raw,
                  headers=upstream_headers(request.headers, request_id),
                  timeout=self._settings.timeouts.first_byte)  # fmt: skip

        async def exchange() -> Upstream | ErrorAnswer:
            return await self._forwarder.open(leg)

        route = request.url.path if request.url.path.count("/") <= 3 else "/v1/other"
        return self._relay(exchange, route, "mixed", request_id)

    def _relay(self, exchange: Exchange, route: str, mode: str, request_id: str) -> RelayResponse:
        return RelayResponse(
            exchange, route=route, mode=mode, request_id=request_id,
            idle_timeout=self._settings.timeouts.stream_idle, metrics=self._metrics,
        )  # fmt: skip

    async def list_models(self, request: Request) -> Response:
        now = int(time.time())
        data = [{"id": m, "object": "model", "created": now, "owned_by": "vllm"} for m in self._pool.models()]
        return JSONResponse({"object": "list", "data": data})
