"""Moves one leg of a request to a node: pick, send, retry before the first byte, hand back the response.

The forwarder decides nothing about *which* node (the policy does) and nothing about the disaggregated
exchange (disagg.py); it opens a response from some node of the leg's roles, retrying on another node
while nothing has reached the client, and hands back an ``Upstream`` whose body the caller relays. The
bytes move through a ``Transport`` (transport.py), which tests may replace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.ejection import Ejector
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import NoNodeAvailable, ProxyError, UpstreamFailed, UpstreamTimeout
from vllm_etcd_proxy.proxy.routing.balancer import Policy
from vllm_etcd_proxy.proxy.serving.request import ProxyRequest
from vllm_etcd_proxy.proxy.settings import ProxySettings
from vllm_etcd_proxy.proxy.telemetry.metrics import ProxyMetrics
from vllm_etcd_proxy.proxy.telemetry.spans import NO_LEG, LegSpan
from vllm_etcd_proxy.proxy.upstream.transport import Origin, Transport, UpstreamRequest, UpstreamResponse

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    [
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    ]
)
NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding", b"x-request-id", b"expect"}
"""Client request headers the nodes never see (the transport sets Host and Content-Length itself)."""
_NOT_RETURNED = HOP_BY_HOP | {b"server", b"date"}
_BUSY = (429, 503)
BUSY_HOLD = 1.0
"""Seconds a node that answered 503 (vLLM while scaling, or overloaded) gets no new requests: they go to
other nodes, or wait for the retry the client is told to make."""
_MAX_ERROR_BODY = 64 * 1024
_ERROR_BODY_SECONDS = 10.0


@dataclass(frozen=True, kw_only=True)
class ErrorAnswer:
    """A node's own error response (5xx or 429), read whole; passed to the client when every attempt failed."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    node_id: str


class Work(StrEnum):
    """What a leg asks of its node (``vllm_proxy_legs_total{leg}``)."""

    WHOLE = "whole"
    """The whole request: prompt and answer on that node."""
    PREFILL = "prefill"
    """The prompt only, its KV cache kept for a decode node to pull."""
    DECODE = "decode"
    """The answer, from the KV cache pulled from the prefill node."""


class Leg(NamedTuple):
    """One HTTP request, of a client request's, to be sent to some node of ``roles`` (tried in order); the model,
    path, headers and routing hints are the client request's (``ProxyRequest``)."""

    roles: tuple[Role, ...]
    body: bytes
    timeout: float
    """Seconds until response headers, per attempt."""
    deadline: float | None = None
    """``time.monotonic()`` by which some attempt must have answered (the prefill leg's total timeout)."""
    body_for: Callable[[NodeState], bytes] | None = None
    """The body for the node chosen, when it depends on the node (instead of ``body``)."""
    narrow: bool = False
    """Candidates narrowed before the policy chooses (a LoRA adapter's nodes where it is active first)."""
    work: Work = Work.WHOLE
    order: Sequence[NodeState] | None = None
    """The nodes to try, best first, instead of asking the role's policy (a split request's legs, placed by
    routing/elastic.py); one that left the pool or takes no request now is skipped."""


def header_lines(headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(b"%s: %s\r\n" % pair for pair in headers)


def client_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A node's response headers as the client gets them: hop-by-hop ones and Server/Date dropped."""
    return [(k, v) for k, v in headers if k.lower() not in _NOT_RETURNED]


class Upstream:
    """An open response from a node: status and headers are in, the body is not read yet."""

    __slots__ = ("state", "role", "work", "response", "_forwarder", "_closed", "span", "after")

    def __init__(
        self,
        forwarder: Forwarder,
        state: NodeState,
        role: Role,
        response: UpstreamResponse,
        span: LegSpan = NO_LEG,
        work: Work = Work.WHOLE,
    ) -> None:
        self._forwarder = forwarder
        self.state = state
        self.role = role
        self.work = work
        self.response = response
        self._closed = False
        self.span = span
        """The leg's span, ended with the response."""
        self.after: Callable[[], None] = _nothing
        """Called once the response is closed (the LoRA loader counts its adapter's requests in flight)."""

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return self.response.headers

    async def read_all(self, limit: int) -> bytes:
        """The whole body (prefill answers are small), bounded in size (the caller bounds the time)."""
        body = bytearray()
        while chunk := await self.response.read():
            body += chunk
            if len(body) > limit:
                raise UpstreamFailed(f"node {self.state.node.node_id} answered more than {limit} bytes")
        return bytes(body)

    def close(self, outcome: str) -> None:
        """Release the node (``outcome``: ok, broken or cancelled); closing early drops the connection, which
        is how vLLM learns to abort the request."""
        if self._closed:
            return
        self._closed = True
        self.response.close()
        self._forwarder.release(self.state, self.role, outcome, failed=outcome == "broken", work=self.work)
        self.span.end(outcome, self.response.status)
        self.after()


def _nothing() -> None:
    return None


Narrow = Callable[[str, list[NodeState]], list[NodeState]]
"""(model, candidates) -> the candidates a leg that narrows goes to (a LoRA adapter's nodes where it is active)."""


class Forwarder:
    """Opens upstream responses through ``transport``, choosing nodes with the role's policy."""

    def __init__(
        self,
        transport: Transport,
        pool: Pool,
        policies: Mapping[Role, Policy],
        settings: ProxySettings,
        metrics: ProxyMetrics,
        ejector: Ejector,
        narrow: Narrow = lambda model, candidates: candidates,
    ) -> None:
        self._transport = transport
        self._ejector = ejector
        self._idle = settings.timeouts.stream_idle
        self._pool = pool
        self._policies = policies
        self._attempts = settings.max_attempts
        self._metrics = metrics
        self._narrow = narrow

    def _candidates(self, model: str, leg: Leg) -> tuple[Role, list[NodeState]]:
        for role in leg.roles:
            found = self._pool.candidates(role, model)
            if found:
                return role, self._narrow(model, found) if leg.narrow else found
        return leg.roles[0], []

    async def open(self, request: ProxyRequest, leg: Leg, avoid: Collection[NodeState] = ()) -> Upstream | ErrorAnswer:
        """Send ``leg`` of ``request`` to a node, retrying elsewhere on connect errors, timeouts, 5xx and 429.

        Returns an ``Upstream`` for a 2xx/4xx answer. When every attempt got an HTTP error answer, returns the
        last one, already read, so the client sees the node's own error. Raises ``ProxyError`` when no node
        could be tried or none answered at all. Nodes in ``avoid`` (the node a resumed stream just failed on)
        count as tried: the policy picks them only when no other node is left. A request with a ``pinned`` node
        goes there or nowhere.
        """
        # A failed node is often the least loaded one (its stalled streams were just released), so without
        # this a continuation would go straight back to the node that stopped sending.
        tried: list[NodeState] = list(avoid)
        last_error: ProxyError | None = None
        last_answer: ErrorAnswer | None = None
        model = request.model or ""
        for attempt in range(self._attempts):
            if leg.deadline is not None and time.monotonic() >= leg.deadline:
                break
            role, state = self.choose(request, leg, tried)
            if state is None:
                break
            if attempt:
                self._metrics.retry(role)
            tried.append(state)
            result = await self._attempt(request, state, role, leg, attempt)
            if isinstance(result, Upstream):
                return result
            if isinstance(result, ErrorAnswer):
                last_answer = result
            else:
                last_error = result
        if last_answer is not None:
            return last_answer
        if last_error is not None:
            raise last_error
        raise NoNodeAvailable(f"no {'/'.join(r.value for r in leg.roles)} node is available for model {model!r}")

    def choose(self, request: ProxyRequest, leg: Leg, tried: Collection[NodeState]) -> tuple[Role, NodeState | None]:
        """The node for the next attempt (None: none is left), and the role it is there as."""
        pinned = request.pinned
        if pinned is not None:
            return pinned.node.role, (pinned if not tried else None)
        if leg.order is not None:
            state = self._next_in_order(leg.order, tried)
            return (state.node.role if state is not None else leg.roles[0]), state
        role, candidates = self._candidates(request.model or "", leg)
        return role, self._policies[role].choose(candidates, tried, request.affinity, request.prompt)

    def _next_in_order(self, order: Sequence[NodeState], tried: Collection[NodeState]) -> NodeState | None:
        """The first node of ``order`` not tried yet that is still in the pool and takes a request now; when every
        such node was tried, the first of them again (as a policy does: it may have been a passing fault)."""
        pool = self._pool
        usable = [s for s in order if pool.get(s.entry_key) is s and s.routable and s.admits]
        return next((s for s in usable if s not in tried), usable[0] if usable else None)

    async def _attempt(
        self, request: ProxyRequest, state: NodeState, role: Role, leg: Leg, attempt: int
    ) -> Upstream | ErrorAnswer | ProxyError:
        node = state.node
        timeout = leg.timeout if leg.deadline is None else min(leg.timeout, leg.deadline - time.monotonic())
        body = leg.body if leg.body_for is None else leg.body_for(state)
        span = request.trace.leg(
            role=role.value, node_id=node.node_id, url=node.url, model=request.model or "", attempt=attempt
        )
        upstream_request = UpstreamRequest(
            origin=Origin.of(node.url),
            path=request.target,
            head=request.head + span.headers,
            body=body,
            timeout=timeout,
            idle_timeout=self._idle,
            method=request.method,
        )
        work = leg.work
        self._pool.request_started(state, prefill=work is Work.PREFILL)
        self._metrics.leg(node.node_id, work.value)
        try:
            response = await self._transport.send(upstream_request)
        except UpstreamTimeout as exc:
            self._failed(state, role, "timeout", span, work=work)
            log.warning("upstream timeout node=%s role=%s error=%s", node.node_id, role.value, exc.message)
            return exc
        except ProxyError as exc:
            self._failed(state, role, "connect_error", span, work=work)
            log.warning("upstream failed node=%s role=%s error=%s", node.node_id, role.value, exc.message)
            return UpstreamFailed(exc.message)
        except BaseException:
            self._failed(state, role, "cancelled", span, failed=False, work=work)
            raise
        status = response.status
        if status >= 500 or status == 429:
            return await self._error_answer(state, role, response, span, work)
        # Headers are no success yet: a wedged engine sends them, then nothing (or breaks the stream). Counting
        # them would reset the node's failures with every new request, so it would never be ejected again and
        # probation would end before the node proved anything; the exchange counts when it ends (release).
        return Upstream(self, state, role, response, span, work)

    async def _error_answer(
        self, state: NodeState, role: Role, response: UpstreamResponse, span: LegSpan, work: Work
    ) -> ErrorAnswer:
        """A node's 5xx or 429, read whole (bounded) so the client can get it when no other node answers."""
        status = response.status
        try:
            body = await _read_bounded(response)
        except (ProxyError, TimeoutError):
            body = b""
        finally:
            response.close()
        busy = status in _BUSY
        if status == 503:
            self._pool.hold_busy(state, BUSY_HOLD)
        self._failed(state, role, f"http_{status}", span, failed=not busy, status=status, work=work)
        log.warning("upstream error node=%s role=%s status=%d", state.node.node_id, role.value, status)
        headers = [(k, v) for k, v in client_headers(response.headers) if k.lower() != b"content-length"]
        return ErrorAnswer(status=status, headers=headers, body=body, node_id=state.node.node_id)

    def _failed(
        self,
        state: NodeState,
        role: Role,
        outcome: str,
        span: LegSpan,
        *,
        failed: bool = True,
        status: int | None = None,
        work: Work = Work.WHOLE,
    ) -> None:
        self.release(state, role, outcome, failed=failed, work=work)
        span.end(outcome, status)

    def release(self, state: NodeState, role: Role, outcome: str, *, failed: bool, work: Work = Work.WHOLE) -> None:
        self._pool.request_ended(state, prefill=work is Work.PREFILL)
        self._metrics.upstream_outcome(role, state.node.node_id, outcome)
        if failed:
            self._ejector.failure(state, outcome)
        elif outcome == "ok":
            self._ejector.success(state)


async def _read_bounded(response: UpstreamResponse) -> bytes:
    body = bytearray()
    async with asyncio.timeout(_ERROR_BODY_SECONDS):
        while len(body) <= _MAX_ERROR_BODY and (chunk := await response.read()):
            body += chunk
    return bytes(body[:_MAX_ERROR_BODY])
