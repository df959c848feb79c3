"""Pure ASGI middleware (no BaseHTTPMiddleware: it would break streaming and disconnect detection)."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

T = TypeVar("T")


class NodeHeader:
    """Adds ``x-sim-node: <node id>`` to every response, so tests see who answered."""

    def __init__(self, app: ASGIApp, node_id: str):
        self.app = app
        self.header = (b"x-sim-node", node_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


class ApiKey:
    """vLLM's --api-key (AuthenticationMiddleware): every HTTP request and WebSocket under /v1, /v2, /inference or
    /cohere needs ``Authorization: Bearer KEY`` (OPTIONS excepted); a WebSocket is refused with the same 401 at the
    upgrade."""

    GUARDED = ("/v1", "/v2", "/inference", "/cohere")

    def __init__(self, app: ASGIApp, key: str):
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] not in ("http", "websocket")
            or scope.get("method") == "OPTIONS"
            or not scope["path"].startswith(self.GUARDED)
        ):
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self.key):
            await self.app(scope, receive, send)
            return
        await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)


SCALING_ERROR = {"error": "The model is currently scaling. Please try again later."}
"""vLLM's elastic-EP ScalingMiddleware answer, with status 503, to every HTTP request while it scales."""


class Scaling:
    """503 to every request but the simulator's own /sim/* while ``is_scaling()``; each refusal is recorded."""

    def __init__(self, app: ASGIApp, is_scaling: Callable[[], bool], refused: Callable[[Scope], None]):
        self.app = app
        self.is_scaling = is_scaling
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/sim/") or not self.is_scaling():
            await self.app(scope, receive, send)
            return
        self.refused(scope)
        await JSONResponse(SCALING_ERROR, status_code=503)(scope, receive, send)


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """Run ``work`` but cancel it as soon as the client disconnects (then raise ClientGone).

    Starlette only watches for disconnects while streaming, and only for some ASGI spec versions; a
    non-streamed generation (or a hung request) would otherwise run on for nobody, holding its slot.
    """
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watcher: asyncio.Future[Any] = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()
