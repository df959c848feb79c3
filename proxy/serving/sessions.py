"""WebSocket sessions (``/v1/realtime`` and any other route vLLM serves over a WebSocket), on the request path of
every HTTP request: the same layers (keys, the replica's concurrency, the tenant's, wake-on-demand, tracing)
refuse or pass them, ``PickFlow`` checks their model is routable, and at its end, in place of the HTTP relay,
``SessionRelay`` connects them to a node and relays them message by message (wsrelay.py).

The model comes from ``?model=``; else the session opens on a node of the fleet's first model and the client's
first message decides: a JSON event naming a model (``session.update``'s ``model`` or ``session.model``, or any
event's top-level ``model``) that this node does not serve moves the session, before that message is forwarded,
to a node that does. vLLM's server speaks first (``session.created``), so the client must get that before it
sends anything; the second node's own ``session.created`` is dropped. Closes travel both ways with their code.

A node is chosen as for an HTTP request (the role's policy, mixed then both then decode nodes); a connect error,
a timeout or a 5xx (or 429) to the handshake counts against the node as an HTTP request's would (ejection) and
the next node is tried; a node's 4xx is the client's answer.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from urllib.parse import parse_qs

from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from websockets.typing import Subprotocol

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.fleet.tls import TLS_HINT, ssl_reason
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import NoNodeAvailable, ProxyError, UpstreamFailed
from vllm_etcd_proxy.proxy.serving.forwarder import Forwarder, Leg, Upstream
from vllm_etcd_proxy.proxy.serving.request import ProxyRequest
from vllm_etcd_proxy.proxy.serving.wsrelay import CLOSE_TIMEOUT, Denied, Link, Session
from vllm_etcd_proxy.proxy.settings import ProxySettings
from vllm_etcd_proxy.proxy.telemetry.metrics import ProxyMetrics

log = logging.getLogger(__name__)

WEBSOCKET_ROUTES = frozenset(["/v1/realtime", "/v1/responses"])
"""Routes named as such in metrics; any other path counts as /v1/other."""
SESSION_ROLES = (Role.MIXED, Role.BOTH, Role.DECODE)


def session_route(path: str) -> str:
    return path if path in WEBSOCKET_ROUTES else "/v1/other"  # bounded metric labels


def query_model(request: ProxyRequest) -> str | None:
    """The model of a session's ``?model=``, if it names one."""
    query: bytes = request.scope.get("query_string", b"")
    models = parse_qs(query.decode("latin-1")).get("model") if query else None
    return models[0] if models else None


def _header_pairs(lines: bytes) -> list[tuple[str, str]]:
    """``name: value`` lines, each ending in CRLF, as pairs."""
    out = []
    for line in lines.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            out.append((name.decode("latin-1"), value.strip().decode("latin-1")))
    return out


class SessionFlow:
    """How a session reaches a node: ``connect`` opens a handshake with a node of the model, trying the next one
    as the forwarder would (the relay at the path's end calls it, there is no HTTP leg to ``open``)."""

    mode = "session"

    def __init__(
        self, pool: Pool, forwarder: Forwarder, metrics: ProxyMetrics, settings: ProxySettings, node_tls: ssl.SSLContext
    ) -> None:
        """``node_tls``: the client context for ``wss://`` to ``https://`` nodes (fleet/tls.py)."""
        self._pool, self._forwarder, self._metrics = pool, forwarder, metrics
        self._node_tls = node_tls
        self._attempts = settings.max_attempts
        self._connect_timeout = settings.timeouts.connect
        self._max_size = settings.max_body_bytes
        self.check: Callable[[str, tuple[Role, ...]], None] = lambda model, roles: None
        """404 when nobody serves a model, 503 when none of its nodes of ``roles`` is routable (``Flows`` sets
        it: the rule of every request)."""

    async def open(self, request: ProxyRequest, avoid: tuple[NodeState, ...] = ()) -> Upstream:
        raise NotImplementedError("a session is relayed by SessionRelay, not opened as an HTTP leg")

    async def connect(self, request: ProxyRequest, model: str) -> Link:
        """A finished handshake with a node serving ``model``. Raises ``ProxyError`` (no node, none reached) or
        ``Denied`` (a node's own refusal, the client's answer)."""
        self.check(model, SESSION_ROLES)
        request.model = model
        leg = Leg(roles=SESSION_ROLES, body=b"", timeout=self._connect_timeout)
        last: Denied | None = None
        tried: list[NodeState] = []
        for attempt in range(self._attempts):
            role, state = self._forwarder.choose(request, leg, tried)
            if state is None:
                break
            tried.append(state)
            if attempt:
                self._metrics.retry(role)
            link = await self._handshake(request, state, role, attempt)
            if isinstance(link, Link):
                return link
            last = link
            if link.outcome == "refused_by_node":
                raise link
        if last is not None:
            raise last
        raise NoNodeAvailable(f"no node is available for model {model!r}")

    async def _handshake(self, request: ProxyRequest, state: NodeState, role: Role, attempt: int) -> Link | Denied:
        node = state.node
        model = request.model or ""
        span = request.trace.leg(role=role.value, node_id=node.node_id, url=node.url, model=model, attempt=attempt)
        url = "ws" + node.url.removeprefix("http") + request.target.decode("latin-1")  # http -> ws, https -> wss
        head = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.forwarded
            if not k.startswith(b"sec-websocket-")  # the websockets client writes the handshake's own
        ]
        head += _header_pairs(span.headers)
        subprotocols = [Subprotocol(p) for p in request.scope.get("subprotocols", ())]
        self._pool.request_started(state)  # least-load sees open sessions
        try:
            ws = await connect(
                url,
                additional_headers=head,
                subprotocols=subprotocols or None,
                user_agent_header=None,
                proxy=None,
                ssl=self._node_tls if url.startswith("wss:") else None,
                compression=None,
                max_size=self._max_size,
                open_timeout=self._connect_timeout,
                close_timeout=CLOSE_TIMEOUT,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            failed = status >= 500 or status == 429
            self._forwarder.release(state, role, f"http_{status}", failed=failed and status != 503)
            span.end(f"http_{status}", status)
            kind = exc.response.headers.get("content-type", "text/plain").encode("latin-1")
            answer = (status, [(b"content-type", kind)], bytes(exc.response.body or b""))
            message = f"node {node.node_id} refused the WebSocket with HTTP {status}"
            return Denied("upstream_failed" if failed else "refused_by_node", 1011, message, answer)
        except (OSError, TimeoutError, ValueError) as exc:  # websockets' handshake errors are ValueErrors
            self._forwarder.release(state, role, "connect_error", failed=True)
            span.end("connect_error", None)
            hint = f" ({ssl_reason(exc)}; {TLS_HINT})" if isinstance(exc, ssl.SSLError) else ""
            log.warning("websocket connect failed node=%s error=%s%s", node.node_id, type(exc).__name__, hint)
            return Denied.of(UpstreamFailed(f"node {node.node_id} could not be reached"), request.request_id)
        except BaseException:
            self._forwarder.release(state, role, "cancelled", failed=False)
            span.end("cancelled", None)
            raise
        return Link(ws=ws, state=state, role=role, span=span)

    def release(self, link: Link, outcome: str) -> None:
        """The session no longer uses ``link``'s node (``outcome`` for the upstream metric; "ok" is a success
        for ejection, a session that broke is not held against the node: its client may have gone)."""
        self._forwarder.release(link.state, link.role, outcome, failed=False)
        link.span.end(outcome, None)


class SessionRelay:
    """The end of the request path for a session: its node connected (``SessionFlow``), the client accepted,
    messages relayed until one side closes."""

    def __init__(self, flow: SessionFlow, metrics: ProxyMetrics) -> None:
        self._flow, self._metrics = flow, metrics

    async def __call__(self, request: ProxyRequest) -> None:
        flow, metrics = self._flow, self._metrics
        asked = query_model(request)
        model = request.model
        assert model is not None  # ReadRequest's
        try:
            link = await flow.connect(request, model)
        except (ProxyError, Denied) as exc:
            await request.deny(Denied.of(exc, request.request_id))
            return

        async def reconnect(other: str) -> Link:
            return await flow.connect(request, other)

        session = Session(
            request.receive,
            request.send,
            link,
            connect=reconnect,
            release=flow.release,
            request_id=request.request_id,
            routed=asked is not None,
        )
        headers = [(b"x-request-id", request.request_id.encode())]
        request.status = 101
        metrics.websocket_opened(request.route)
        outcome = "error"
        try:
            outcome = await session.run(
                {"type": "websocket.accept", "subprotocol": link.ws.subprotocol, "headers": headers}
            )
        finally:
            metrics.websocket_done(request.route, outcome, opened=True)
