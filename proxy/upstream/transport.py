"""The data path's HTTP/1.1 client to the nodes: asyncio protocols parsed by httptools.

Made for relaying streams, and nothing else (httpx serves the control plane):

- each node has its own idle connections, reused most-recent-first (``connections``);
- a request (head and body) goes out in one socket write;
- body bytes that arrived together are handed over together, as one ``bytes`` (``connection``);
- a response that is closed before its end closes its connection at once (that is how vLLM learns to abort).

``Transport`` is the one-method interface the forwarder uses; tests can swap in their own.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from dataclasses import dataclass
from typing import NamedTuple, Protocol
from urllib.parse import urlsplit

from vllm_etcd_proxy.proxy.errors import UpstreamFailed
from vllm_etcd_proxy.proxy.upstream.connection import Connection, Response
from vllm_etcd_proxy.proxy.upstream.connections import NodeConnections


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a node listens, parsed once from its URL."""

    scheme: str
    host: str
    port: int
    host_header: bytes

    @staticmethod
    def of(url: str) -> Origin:
        """The origin of a node's ``url``; parsed once per URL (a bounded cache: nodes come and go)."""
        return _parse_origin(url)


@functools.lru_cache(maxsize=4096)
def _parse_origin(url: str) -> Origin:
    parts = urlsplit(url)
    scheme, host = parts.scheme, parts.hostname or ""
    port = parts.port or (443 if scheme == "https" else 80)
    return Origin(scheme=scheme, host=host, port=port, host_header=parts.netloc.encode("ascii"))


_BODY_METHODS = frozenset([b"POST", b"PUT", b"PATCH"])
"""Methods whose requests always carry a Content-Length (0 for an empty body); others only with a body."""


class UpstreamRequest(NamedTuple):
    """One request to a node: any method; a body goes with a Content-Length.
    ``head`` holds the request's header lines (each ending in CRLF) other than Host and Content-Length, which the
    transport adds."""

    origin: Origin
    path: bytes
    head: bytes
    body: bytes
    timeout: float
    """Seconds until the response headers."""
    idle_timeout: float
    """Longest gap between two reads of the response body."""
    method: bytes = b"POST"


class UpstreamResponse(Protocol):
    status: int
    headers: list[tuple[bytes, bytes]]

    async def read(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); ``b""`` at the end.
        Raises ``UpstreamFailed`` when the node breaks off, ``UpstreamTimeout`` after the idle timeout."""
        ...

    def close(self) -> None:
        """Done with the response: a complete one gives its connection back for reuse, any other closes it."""
        ...


class Transport(Protocol):
    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        """Send ``request`` and return once the response headers are in. Raises ``UpstreamFailed`` (could not
        connect, or the connection broke before a response) or ``UpstreamTimeout``."""
        ...


class HttpTransport:
    """``Transport`` over keep-alive HTTP/1.1 connections, pooled per node."""

    def __init__(self, *, connect_timeout: float, max_connections: int, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: the client context for ``https://`` nodes (fleet/tls.py); None: the system's CAs, built on
        first use."""
        self._connect_timeout = connect_timeout
        self._limit = max_connections
        self._pools: dict[Origin, NodeConnections] = {}
        self._ssl = tls

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def prepare_tls(self) -> None:
        """Build the TLS context now (it takes tens of milliseconds), not in the middle of a request."""
        self._ssl_context()

    def _pool(self, origin: Origin) -> NodeConnections:
        pool = self._pools.get(origin)
        if pool is None:
            loop = asyncio.get_running_loop()
            pool = self._pools[origin] = NodeConnections(
                origin, loop, self._limit, self._connect_timeout, self._ssl_context
            )
        return pool

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        pool = self._pool(request.origin)
        origin = request.origin
        if request.body or request.method in _BODY_METHODS:
            wire = b"".join(
                (
                    request.method,
                    b" ",
                    request.path,
                    b" HTTP/1.1\r\nhost: ",
                    origin.host_header,
                    b"\r\ncontent-length: ",
                    str(len(request.body)).encode(),
                    b"\r\n",
                    request.head,
                    b"\r\n",
                    request.body,
                )
            )
        else:
            wire = b"".join(
                (
                    request.method,
                    b" ",
                    request.path,
                    b" HTTP/1.1\r\nhost: ",
                    origin.host_header,
                    b"\r\n",
                    request.head,
                    b"\r\n",
                )
            )
        conn = pool.take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, pool, wire, request)
            except UpstreamFailed:
                # A reused connection the node closed while it sat idle: the node never saw the request.
                if conn.had_bytes:
                    raise
        return await self._exchange(await pool.connect(request.timeout), pool, wire, request)

    async def _exchange(
        self, conn: Connection, pool: NodeConnections, wire: bytes, request: UpstreamRequest
    ) -> Response:
        response = Response(conn, pool.loop)
        conn.response = response
        assert conn.transport is not None
        try:
            conn.transport.write(wire)
            await response.wait_head(request.timeout, pool.name)
        except BaseException:
            conn.had_bytes = response.bytes_seen
            response.close()
            raise
        response.start_idle_timer(request.idle_timeout, pool.name)
        return response

    def open_connections(self, url: str) -> int:
        """Connections open to the node at ``url`` (for /list_workers and tests)."""
        pool = self._pools.get(Origin.of(url))
        return pool.open if pool is not None else 0

    def prune(self, live_urls: set[str]) -> None:
        """Close the idle connections of nodes no longer known."""
        live = {Origin.of(url) for url in live_urls}
        for origin in [o for o in self._pools if o not in live]:
            pool = self._pools[origin]
            pool.close_all()
            if pool.open == 0:
                del self._pools[origin]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close_all()
        self._pools.clear()
