"""Moves one leg of a request to a node: pick, send, retry before the first byte, relay the body.

The forwarder decides nothing about *which* node (the policy does) and nothing about the disaggregated
exchange (disagg.py); it opens a response from some node of the leg's roles, retrying on another node
while nothing has reached the client, and hands back an ``Upstream`` whose body the caller relays.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx

from proxy.balancer import Policy
from proxy.ejection import Ejector
from proxy.errors import NoNodeAvailable, ProxyError, UpstreamFailed, UpstreamTimeout
from proxy.metrics import ProxyMetrics
from proxy.pool import NodeState, Pool
from proxy.records import Role
from proxy.settings import ProxySettings
from proxy.upstream import NodeClients, Shard

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    ["connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
     "transfer-encoding", "upgrade"]
)  # fmt: skip
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "accept-encoding"}
_NOT_RETURNED = HOP_BY_HOP | {"server", "date"}
_BUSY = (429, 503)
_MAX_ERROR_BODY = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class ErrorAnswer:
    """A node's own error response (5xx or 429), read whole; passed to the client when every attempt failed."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    node_id: str


@dataclass(frozen=True, kw_only=True)
class Leg:
    """One HTTP request to be sent to some node of ``roles`` (tried in order) serving ``model``."""

    roles: tuple[Role, ...]
    model: str
    path: str
    body: bytes
    headers: Mapping[str, str]
    timeout: float
    """Seconds until response headers (the prefill leg uses its total timeout here)."""
    affinity: str | None = None
    """Key the consistent-hash policy routes by (session, user or prompt prefix); None for the others."""


def upstream_headers(
    client_headers: Mapping[str, str], request_id: str, backend_key: str | None = None
) -> dict[str, str]:
    """The client's headers minus hop-by-hop ones, with the request id both legs share. With a backend key,
    the node sees that key instead of the client's Authorization."""
    dropped = _NOT_FORWARDED | {"x-request-id"} | ({"authorization"} if backend_key else set())
    headers = {k: v for k, v in client_headers.items() if k.lower() not in dropped}
    headers["x-request-id"] = request_id
    if backend_key:
        headers["authorization"] = f"Bearer {backend_key}"
    return headers


def client_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    """Response headers to pass back to the client."""
    return [(k, v) for k, v in response.headers.raw if k.lower().decode("latin-1") not in _NOT_RETURNED]


class Upstream:
    """An open response from a node: status and headers are in, the body is not read yet."""

    def __init__(self, forwarder: Forwarder, state: NodeState, role: Role, response: httpx.Response, shard: Shard):
        self._forwarder = forwarder
        self._shard = shard
        self.state = state
        self.role = role
        self.response = response
        self._closed = False

    @property
    def status(self) -> int:
        return self.response.status_code

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; ``UpstreamTimeout`` after the stream-idle timeout without a byte."""
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
        except httpx.TimeoutException:
            raise UpstreamTimeout(f"node {self.state.node.node_id} stopped sending (stream idle timeout)") from None
        except httpx.HTTPError as exc:
            raise UpstreamFailed(f"node {self.state.node.node_id} broke off the response: {exc!r}") from None

    async def read(self, limit: int) -> bytes:
        """The whole body (prefill responses are small); bounded in size (the caller bounds the time)."""
        body = bytearray()
        async for chunk in self.chunks():
            body += chunk
            if len(body) > limit:
                raise UpstreamFailed(f"node {self.state.node.node_id} answered more than {limit} bytes")
        return bytes(body)

    async def aclose(self, outcome: str) -> None:
        """Release the node (``outcome``: ok, broken or cancelled); closing early drops the connection, which
        is how vLLM learns to abort the request."""
        if self._closed:
            return
        self._closed = True
        self._forwarder.release(self.state, self._shard, self.role, outcome, failed=outcome == "broken")
        await self.response.aclose()


class Forwarder:
    """Opens upstream responses, one connection pool per node (upstream.py)."""

    def __init__(
        self,
        clients: NodeClients,
        pool: Pool,
        policies: Mapping[Role, Policy],
        settings: ProxySettings,
        metrics: ProxyMetrics,
        ejector: Ejector,
    ) -> None:
        self._ejector = ejector
        self._idle = settings.timeouts.stream_idle
        self._clients = clients
        self._pool = pool
        self._policies = policies
        self._settings = settings
        self._metrics = metrics

    def _candidates(self, leg: Leg) -> tuple[Role, list[NodeState]]:
        for role in leg.roles:
            found = self._pool.candidates(role, leg.model)
            if found:
                return role, found
        return leg.roles[0], []

    async def open(self, leg: Leg) -> Upstream | ErrorAnswer:
        """Send ``leg`` to a node, retrying elsewhere on connect errors, timeouts, 5xx and 429.

        Returns an ``Upstream`` for a 2xx/4xx answer. When every attempt got an HTTP error answer, returns the
        last one, already read, so the client sees the node's own error. Raises ``ProxyError`` when no node
        could be tried or none answered at all.
        """
        tried: list[NodeState] = []
        last_error: ProxyError | None = None
        last_answer: ErrorAnswer | None = None
        for attempt in range(self._settings.max_attempts):
            role, candidates = self._candidates(leg)
            state = self._policies[role].choose(candidates, tried, leg.affinity)
            if state is None:
                break
            if attempt:
                self._metrics.retries.labels(role.value).inc()
            tried.append(state)
            result = await self._attempt(state, role, leg)
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
        raise NoNodeAvailable(f"no {'/'.join(r.value for r in leg.roles)} node is available for model {leg.model!r}")

    async def _attempt(self, state: NodeState, role: Role, leg: Leg) -> Upstream | ErrorAnswer | ProxyError:
        node = state.node
        shard = self._clients.acquire(node.url)
        state.in_flight += 1
        try:
            request = shard.client.build_request("POST", node.url + leg.path, content=leg.body, headers=leg.headers)
            async with asyncio.timeout(leg.timeout):
                response = await shard.client.send(request, stream=True)
        except TimeoutError:
            self.release(state, shard, role, "timeout", failed=True)
            log.warning("upstream timeout node=%s role=%s after=%gs", node.node_id, role.value, leg.timeout)
            return UpstreamTimeout(f"node {node.node_id} did not answer within {leg.timeout:g} s")
        except httpx.TimeoutException as exc:
            self.release(state, shard, role, "timeout", failed=True)
            log.warning("upstream timeout node=%s role=%s error=%r", node.node_id, role.value, exc)
            return UpstreamTimeout(f"node {node.node_id} timed out: {type(exc).__name__}")
        except httpx.HTTPError as exc:
            self.release(state, shard, role, "connect_error", failed=True)
            log.warning("upstream failed node=%s role=%s error=%r", node.node_id, role.value, exc)
            return UpstreamFailed(f"node {node.node_id} failed: {type(exc).__name__}")
        except BaseException:
            self.release(state, shard, role, "cancelled", failed=False)
            raise
        if response.status_code >= 500 or response.status_code == 429:
            try:
                body = await _read_bounded(response)
            except (httpx.HTTPError, TimeoutError):
                body = b""
            finally:
                await response.aclose()
            busy = response.status_code in _BUSY
            self.release(state, shard, role, f"http_{response.status_code}", failed=not busy)
            log.warning("upstream error node=%s role=%s status=%d", node.node_id, role.value, response.status_code)
            headers = [(k, v) for k, v in client_headers(response) if k.lower() != b"content-length"]
            return ErrorAnswer(status=response.status_code, headers=headers, body=body, node_id=node.node_id)
        # From here on the read timeout is the gap allowed between body chunks. httpcore reads it from the
        # request's extensions when the body iteration starts, so one timeout per socket read (which it sets
        # up anyway) replaces a timer of ours per chunk.
        response.request.extensions["timeout"] = {**request.extensions.get("timeout", {}), "read": self._idle}
        # The node answered: that ends probation even before the body (a long generation) is through.
        self._ejector.success(state)
        return Upstream(self, state, role, response, shard)

    def release(self, state: NodeState, shard: Shard, role: Role, outcome: str, *, failed: bool) -> None:
        self._clients.release(shard)
        state.in_flight -= 1
        state.served += 1
        self.record(state, role, outcome, failed=failed)

    def record(self, state: NodeState, role: Role, outcome: str, *, failed: bool) -> None:
        """Count an outcome against a node; the ejector ejects nodes that keep failing."""
        self._metrics.upstream.labels(role.value, state.node.node_id, outcome).inc()
        if failed:
            self._ejector.failure(state, outcome)
        elif outcome == "ok":
            self._ejector.success(state)


async def _read_bounded(response: httpx.Response) -> bytes:
    body = bytearray()
    async with asyncio.timeout(10):
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > _MAX_ERROR_BODY:
                break
    return bytes(body[:_MAX_ERROR_BODY])
