"""WebSocket routes (``/v1/realtime`` and any other vLLM serves): one node per connection, message by message.

The model comes from ``?model=``; else the session opens on a node of the fleet's first model and the client's
first message decides: a JSON event naming a model (``session.update``'s ``model`` or ``session.model``, or any
event's top-level ``model``) that this node does not serve moves the session, before that message is forwarded,
to a node that does. vLLM's server speaks first (``session.created``), so the client must get that before it
sends anything; the second node's own ``session.created`` is dropped. Closes travel both ways with their code.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import parse_qs

from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from websockets.typing import Subprotocol

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.fleet.tls import TLS_HINT, ssl_reason
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import ModelNotFound, NoNodeAvailable, ProxyError, UpstreamFailed
from vllm_etcd_proxy.proxy.routing.balancer import Policy
from vllm_etcd_proxy.proxy.serving.guard import SessionGuard, SessionHold
from vllm_etcd_proxy.proxy.serving.parsing import read_headers
from vllm_etcd_proxy.proxy.serving.wsrelay import CLOSE_TIMEOUT, Denied, Link, Session, reason_text
from vllm_etcd_proxy.proxy.settings import ProxySettings
from vllm_etcd_proxy.proxy.telemetry.metrics import ProxyMetrics

log = logging.getLogger(__name__)

WEBSOCKET_ROUTES = frozenset(["/v1/realtime", "/v1/responses"])
"""Routes named as such in metrics; any other path counts as /v1/other."""
_ROLES = (Role.MIXED, Role.BOTH, Role.DECODE)


class _Handshake(NamedTuple):
    """What every node of the session is sent when it is connected."""

    target: str
    """Path and query."""
    head: list[tuple[str, str]]
    subprotocols: list[Subprotocol]
    request_id: str


class WebSocketProxy:
    """The ASGI handler of every WebSocket connection: check the key and take the session's slots (``guard``),
    pick a node, relay until one side closes."""

    def __init__(
        self,
        pool: Pool,
        policies: Mapping[Role, Policy],
        guard: SessionGuard,
        metrics: ProxyMetrics,
        settings: ProxySettings,
        node_tls: ssl.SSLContext,
    ) -> None:
        """``node_tls``: the client context for ``wss://`` to ``https://`` nodes (fleet/tls.py)."""
        self._pool, self._policies, self._guard, self._metrics = pool, policies, guard, metrics
        self._node_tls = node_tls
        self._attempts = settings.max_attempts
        self._connect_timeout = settings.timeouts.connect
        self._max_size = settings.max_body_bytes
        self._session_header = settings.affinity_header.encode("latin-1")
        key = settings.backend_api_key
        self._backend_auth = f"Bearer {key}".encode("latin-1") if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        path: str = scope["path"]
        route = path if path in WEBSOCKET_ROUTES else "/v1/other"  # bounded metric labels
        client = read_headers(scope, session_header=self._session_header, backend_auth=self._backend_auth)
        query: bytes = scope.get("query_string", b"")
        target = (scope.get("raw_path") or path.encode()) + (b"?" + query if query else b"")
        # The websockets client writes the handshake's own headers (key, version, extensions, protocols).
        head = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in client.forwarded
            if not k.startswith(b"sec-websocket-")
        ]
        hello = _Handshake(
            target.decode("latin-1"), head, [Subprotocol(p) for p in scope.get("subprotocols", ())], client.request_id
        )
        models = parse_qs(query.decode("latin-1")).get("model")
        hold: SessionHold | None = None  # the session's slots, given back however it ends
        try:
            try:
                hold = await self._guard.open(client.authorization)
                link = await self.connect(models[0] if models else self._first_model(), hello)
            except (ProxyError, Denied) as exc:
                denied = Denied.of(exc, client.request_id)
                await _deny(scope, send, denied)
                self._metrics.websocket_done(route, denied.outcome)
                return
            await self._relay(receive, send, route, link, hello, routed=bool(models))
        finally:
            if hold is not None:
                hold.close()

    async def _relay(
        self, receive: Receive, send: Send, route: str, link: Link, hello: _Handshake, *, routed: bool
    ) -> None:
        async def reconnect(model: str) -> Link:
            return await self.connect(model, hello)

        session = Session(
            receive,
            send,
            link,
            connect=reconnect,
            release=self._release_link,
            request_id=hello.request_id,
            routed=routed,
        )
        headers = [(b"x-request-id", hello.request_id.encode())]
        self._metrics.websocket_opened(route)
        outcome = "error"
        try:
            outcome = await session.run(
                {"type": "websocket.accept", "subprotocol": link.ws.subprotocol, "headers": headers}
            )
        finally:
            self._metrics.websocket_done(route, outcome, opened=True)

    def _first_model(self) -> str:
        # vLLM's rule for a request that names no model, within what the fleet serves.
        models = self._pool.models()
        if not models:
            raise NoNodeAvailable("no node serves any model right now; retry shortly")
        return models[0]

    def _candidates(self, model: str) -> tuple[Role, list[NodeState]]:
        """Mixed, then decode nodes routable for ``model``; 404 when nobody serves it, 503 when none is up."""
        for role in _ROLES:
            found = self._pool.candidates(role, model)
            if found:
                return role, found
        if any(model in s.models for s in self._pool.all()):
            raise NoNodeAvailable(f"no node is available for model {model!r} right now; retry shortly")
        known = ", ".join(self._pool.models()) or "none"
        raise ModelNotFound(f"The model `{model}` does not exist. Known models: {known}.", param="model")

    async def connect(self, model: str, hello: _Handshake) -> Link:
        """A finished handshake with a node serving ``model``. Connect errors and 5xx try another node, as the
        HTTP path does before the first byte; a node's 4xx is the client's answer. Raises ``ProxyError`` or
        ``Denied``."""
        last: Denied | None = None
        tried: list[NodeState] = []
        for _ in range(self._attempts):
            role, candidates = self._candidates(model)
            state = self._policies[role].choose(candidates, tried, None)
            if state is None:
                break
            tried.append(state)
            url = "ws" + state.node.url.removeprefix("http") + hello.target  # http -> ws, https -> wss
            secure = url.startswith("wss:")
            self._pool.request_started(state)  # least-load sees open sessions
            try:
                ws = await connect(
                    url,
                    additional_headers=hello.head,
                    subprotocols=hello.subprotocols or None,
                    user_agent_header=None,
                    proxy=None,
                    ssl=self._node_tls if secure else None,
                    compression=None,
                    max_size=self._max_size,
                    open_timeout=self._connect_timeout,
                    close_timeout=CLOSE_TIMEOUT,
                )
            except InvalidStatus as exc:
                status = exc.response.status_code
                self.release(state, role, f"http_{status}")
                kind = exc.response.headers.get("content-type", "text/plain").encode("latin-1")
                answer = (status, [(b"content-type", kind)], bytes(exc.response.body or b""))
                message = f"node {state.node.node_id} refused the WebSocket with HTTP {status}"
                last = Denied("upstream_failed" if status >= 500 else "refused_by_node", 1011, message, answer)
                if status < 500 and status != 429:
                    raise last from None
            except (OSError, TimeoutError, ValueError) as exc:  # websockets' handshake errors are ValueErrors
                self.release(state, role, "connect_error")
                hint = f" ({ssl_reason(exc)}; {TLS_HINT})" if isinstance(exc, ssl.SSLError) else ""
                log.warning("websocket connect failed node=%s error=%s%s", state.node.node_id, type(exc).__name__, hint)
                last = Denied.of(UpstreamFailed(f"node {state.node.node_id} could not be reached"), hello.request_id)
            except BaseException:
                self.release(state, role, "cancelled")
                raise
            else:
                return Link(ws=ws, state=state, role=role)
        if last is not None:
            raise last
        raise NoNodeAvailable(f"no node is available for model {model!r}")

    def release(self, state: NodeState, role: Role, outcome: str) -> None:
        """This connection no longer uses the node (``outcome`` for the upstream metric)."""
        self._pool.request_ended(state)
        self._metrics.upstream_outcome(role, state.node.node_id, outcome)

    def _release_link(self, link: Link, outcome: str) -> None:
        self.release(link.state, link.role, outcome)


async def _deny(scope: Scope, send: Send, denied: Denied) -> None:
    """Refuse the handshake: an HTTP answer where the server can send one, else a close (HTTP 403)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        status, headers, body = denied.answer
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": denied.code, "reason": reason_text(denied.message)})
