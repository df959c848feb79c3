"""vLLM's API, as raw ASGI: the entry of every proxied request.

Every path that is not the replica's own (``routes.py``) is forwarded, any method, with no framework objects per
request: the entry makes one ``ProxyRequest`` (request.py) and hands it to the layers (layers.py), the last of
which is the relay (relay.py). A WebSocket session goes through the same layers (sessions.py). The replica's own
routes (``GET /v1/models``, health, status, the admin API) go on to the starlette app.

Completions and chat completions use the disaggregated flow when the model has prefill and decode nodes, else
mixed nodes (then decode nodes on their own). ``POST /v1/responses`` goes where its ``previous_response_id`` is
kept, and every by-id Responses route to the node holding that id (``responses.py``). Any other route goes to a
node serving the request's model: from the JSON body, a multipart or urlencoded form field, the query string, or
else the first model the fleet serves (vLLM's rule for a request that names none). Bodies are forwarded byte for
byte (a new response's body gains only its ``request_id``), so every vLLM feature keeps working.
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_etcd_proxy.proxy.serving.layers import Handler
from vllm_etcd_proxy.proxy.serving.parsing import read_headers
from vllm_etcd_proxy.proxy.serving.request import ProxyRequest
from vllm_etcd_proxy.proxy.serving.routes import Kind, classify, metric_route
from vllm_etcd_proxy.proxy.serving.sessions import session_route

FORWARDED_METHODS = frozenset(["GET", "POST", "PUT", "PATCH", "DELETE"])


class OpenAIRoutes:
    """ASGI app: every forwarded request and WebSocket session into ``handler`` (the layers), and ``fallback`` for
    every other request."""

    def __init__(
        self,
        handler: Handler,
        fallback: ASGIApp,
        *,
        session_header: str,
        backend_api_key: str | None,
    ) -> None:
        self._handler = handler
        self._fallback = fallback
        self._session_header = session_header.encode("latin-1")
        self._backend_auth = f"Bearer {backend_api_key}".encode("latin-1") if backend_api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            kind = classify(path)
            if kind is not Kind.OWN and scope["method"] in FORWARDED_METHODS:
                started = time.monotonic()
                client = read_headers(scope, session_header=self._session_header, backend_auth=self._backend_auth)
                route = metric_route(path, kind)
                request = ProxyRequest(scope, receive, send, kind=kind, route=route, started=started, client=client)
                await self._handler(request)
                return
        elif scope["type"] == "websocket":
            if (await receive())["type"] != "websocket.connect":
                return
            client = read_headers(scope, session_header=self._session_header, backend_auth=self._backend_auth)
            route = session_route(scope["path"])
            request = ProxyRequest(
                scope, receive, send, kind=Kind.SESSION, route=route, started=time.monotonic(), client=client
            )
            await self._handler(request)
            return
        await self._fallback(scope, receive, send)
