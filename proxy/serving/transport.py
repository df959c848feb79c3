"""The data path's HTTP/1.1 client to the nodes: asyncio protocols parsed by httptools.

Made for relaying streams, and nothing else (httpx serves the control plane):

- each node has its own idle connections, reused most-recent-first (a stack: no scan per request); the
  least recently used are the ones that expire, so a stale connection is never tried before a fresh one;
- a request (head and body) goes out in one socket write;
- body bytes that arrived together are handed over together, as one ``bytes``;
- a response that is closed before its end closes its connection at once (that is how vLLM learns to abort).

``Transport`` is the one-method interface the forwarder uses; tests can swap in their own.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol, cast
from urllib.parse import urlsplit

import httptools

from vllm_etcd_proxy.proxy.errors import UpstreamFailed, UpstreamTimeout

KEEPALIVE_SECONDS = 4.0
"""Idle connections older than this are closed, not reused: vLLM's server (uvicorn) closes them after 5 s."""
PAUSE_BYTES = 1 << 20
"""Body bytes buffered for a slow client before the node's connection stops being read."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a node listens, parsed once from its URL."""

    scheme: str
    host: str
    port: int
    host_header: bytes

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        scheme, host = parts.scheme, parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        return cls(scheme=scheme, host=host, port=port, host_header=parts.netloc.encode("ascii"))


class UpstreamRequest(NamedTuple):
    """One POST to a node. ``head`` holds the request's header lines (each ending in CRLF) other than Host and
    Content-Length, which the transport adds."""

    origin: Origin
    path: bytes
    head: bytes
    body: bytes
    timeout: float
    """Seconds until the response headers."""
    idle_timeout: float
    """Longest gap between two reads of the response body."""


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


class _Response:
    """A response being read from one connection; filled in by the connection's parser callbacks."""

    __slots__ = ("status", "headers", "_conn", "_loop", "_parts", "_buffered", "_waiter", "_error", "complete",
                 "head_done", "last_read", "_timer", "_idle", "bytes_seen")  # fmt: skip

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._conn = conn
        self._loop = loop
        self._parts: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: Exception | None = None
        self.complete = False
        self.head_done = False
        self.last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._idle = 0.0
        self.bytes_seen = False

    # -- called by the connection ---------------------------------------------------------------------

    def body(self, data: bytes) -> None:
        self._parts.append(data)
        self._buffered += len(data)
        if self._buffered > PAUSE_BYTES:
            self._conn.pause()

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: Exception) -> None:
        if self._error is None and not self.complete:
            self._error = error
        self.wake()

    # -- used by the forwarder ------------------------------------------------------------------------

    async def wait_head(self, timeout: float, node: str) -> None:
        timer = self._loop.call_later(timeout, self._head_timeout, timeout, node)
        try:
            while not self.head_done:
                if self._error is not None:
                    raise self._error
                self._waiter = self._loop.create_future()
                await self._waiter
        finally:
            timer.cancel()

    def _head_timeout(self, timeout: float, node: str) -> None:
        self.fail(UpstreamTimeout(f"node {node} did not answer within {timeout:g} s"))

    def start_idle_timer(self, idle: float, node: str) -> None:
        self._idle = idle
        self.last_read = self._loop.time()
        if not self.complete:
            self._timer = self._loop.call_at(self.last_read + idle, self._check_idle, node)

    def _check_idle(self, node: str) -> None:
        # One timer per idle period, not one per read: it re-arms itself from the time of the last read.
        self._timer = None
        if self.complete or self._error is not None:
            return
        due = self.last_read + self._idle
        if self._loop.time() >= due:
            self.fail(UpstreamTimeout(f"node {node} stopped sending (stream idle timeout)"))
        else:
            self._timer = self._loop.call_at(due, self._check_idle, node)

    async def read(self) -> bytes:
        while True:
            parts = self._parts
            if parts:
                data = parts[0] if len(parts) == 1 else b"".join(parts)
                self._parts = []
                if self._buffered > PAUSE_BYTES:
                    self._conn.resume()
                self._buffered = 0
                return data
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            self._waiter = self._loop.create_future()
            await self._waiter

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._conn.finish(self)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a node, carrying one request at a time."""

    def __init__(self, pool: _NodePool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.response: _Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self._paused = False
        self.counted = True
        """Counted in the pool's open connections (until it closes)."""
        self.had_bytes = False
        """The last response on this connection received bytes before it ended."""
        self._reusable = False
        """The node allows another request on this connection (keep-alive), as of its last response."""

    # -- asyncio.Protocol -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # nothing asked: a confused node; never reuse this connection
            self.close()
            return
        response.last_read = self._loop.time()
        response.bytes_seen = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response.fail(UpstreamFailed(f"node {self._pool.name} sent a malformed response: {exc}"))
            self.close()
            return
        response.wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.lost(self)
        response = self.response
        if response is None or response.complete:
            return
        if response.head_done and exc is None and _reads_to_close(response.headers):
            response.complete = True  # a body delimited by the end of the connection
            response.wake()
            return
        reason = f"{type(exc).__name__}" if exc is not None else "connection closed"
        response.fail(UpstreamFailed(f"node {self._pool.name} broke off the response ({reason})"))

    def pause_writing(self) -> None:  # a request body bigger than the socket buffer: asyncio buffers it
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks --------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self._parser.get_status_code()
        if status < 200:  # 1xx: the real head follows
            response.headers = []
            return
        response.status = status
        response.head_done = True

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response.body(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None and response.head_done:
            response.complete = True
            # Asked now: once the callback returns, the parser has moved on and always answers False.
            self._reusable = self._parser.should_keep_alive()

    # -- used by the pool and the response -----------------------------------------------------------

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def finish(self, response: _Response) -> None:
        if self.response is not response:
            return
        self.response = None
        reusable = response.complete and not self.closed and self._reusable
        self._reusable = False
        if reusable:
            self.resume()
            self._pool.give_back(self)
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
            self._pool.lost(self)


def _reads_to_close(headers: list[tuple[bytes, bytes]]) -> bool:
    return not any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in headers)


class _NodePool:
    """The connections to one node: idle ones on a stack, a cap on how many are open."""

    def __init__(self, origin: Origin, loop: asyncio.AbstractEventLoop, limit: int, connect_timeout: float,
                 ssl_context: Callable[[], ssl.SSLContext]) -> None:  # fmt: skip
        self.origin = origin
        self.name = f"{origin.host}:{origin.port}"
        self.loop = loop
        self._limit = limit
        self._connect_timeout = connect_timeout
        self._ssl_context = ssl_context
        self._idle: list[_Connection] = []
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def open(self) -> int:
        return self._open

    def take_idle(self) -> _Connection | None:
        idle = self._idle
        if not idle:
            return None
        conn = idle.pop()
        if self.loop.time() - conn.idle_since <= KEEPALIVE_SECONDS:
            return conn
        # The freshest idle connection is too old, so are all the others below it on the stack.
        stale, self._idle = [*idle, conn], []
        for old in stale:
            old.close()
        return None

    async def connect(self, wait: float) -> _Connection:
        """A new connection, or an idle one freed while the node was at its limit (waiting up to ``wait`` s)."""
        if self._open >= self._limit:
            try:
                async with asyncio.timeout(wait):
                    while self._open >= self._limit:
                        waiter = self.loop.create_future()
                        self._waiters.append(waiter)
                        try:
                            await waiter
                        finally:
                            if waiter in self._waiters:
                                self._waiters.remove(waiter)
                        conn = self.take_idle()
                        if conn is not None:
                            return conn
            except TimeoutError:
                raise UpstreamTimeout(f"node {self.name}: all {self._limit} connections stayed busy for "
                                      f"{wait:g} s") from None  # fmt: skip
        self._open += 1
        conn = _Connection(self)
        origin = self.origin
        try:
            async with asyncio.timeout(self._connect_timeout):
                if origin.scheme == "https":
                    await self.loop.create_connection(
                        lambda: conn, origin.host, origin.port, ssl=self._ssl_context(), server_hostname=origin.host
                    )
                else:
                    await self.loop.create_connection(lambda: conn, origin.host, origin.port)
        except TimeoutError:
            self._forget(conn)
            raise UpstreamTimeout(f"node {self.name}: no connection within {self._connect_timeout:g} s") from None
        except OSError as exc:
            self._forget(conn)
            raise UpstreamFailed(f"node {self.name}: cannot connect ({exc.strerror or type(exc).__name__})") from None
        except BaseException:
            self._forget(conn)
            raise
        return conn

    def _forget(self, conn: _Connection) -> None:
        if not conn.closed:
            conn.closed = True
            if conn.transport is not None:
                conn.transport.close()
            self.lost(conn)

    def give_back(self, conn: _Connection) -> None:
        conn.idle_since = self.loop.time()
        self._idle.append(conn)
        self._wake_one()

    def lost(self, conn: _Connection) -> None:
        """A connection closed (by either side): it no longer counts, and is no longer offered."""
        if not conn.counted:
            return
        conn.counted = False
        self._open -= 1
        if conn in self._idle:
            self._idle.remove(conn)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close_all(self) -> None:
        for conn in list(self._idle):
            conn.close()


class HttpTransport:
    """``Transport`` over keep-alive HTTP/1.1 connections, pooled per node."""

    def __init__(self, *, connect_timeout: float, max_connections: int) -> None:
        self._connect_timeout = connect_timeout
        self._limit = max_connections
        self._pools: dict[Origin, _NodePool] = {}
        self._ssl: ssl.SSLContext | None = None

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def prepare_tls(self) -> None:
        """Build the TLS context now (it takes tens of milliseconds), not in the middle of a request."""
        self._ssl_context()

    def _pool(self, origin: Origin) -> _NodePool:
        pool = self._pools.get(origin)
        if pool is None:
            loop = asyncio.get_running_loop()
            pool = self._pools[origin] = _NodePool(origin, loop, self._limit, self._connect_timeout,
                                                   self._ssl_context)  # fmt: skip
        return pool

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        pool = self._pool(request.origin)
        origin = request.origin
        wire = b"".join((b"POST ", request.path, b" HTTP/1.1\r\nhost: ", origin.host_header,
                         b"\r\ncontent-length: ", str(len(request.body)).encode(), b"\r\n", request.head, b"\r\n",
                         request.body))  # fmt: skip
        conn = pool.take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, pool, wire, request)
            except UpstreamFailed:
                # A reused connection the node closed while it sat idle: the node never saw the request.
                if conn.had_bytes:
                    raise
        return await self._exchange(await pool.connect(request.timeout), pool, wire, request)

    async def _exchange(self, conn: _Connection, pool: _NodePool, wire: bytes,
                        request: UpstreamRequest) -> _Response:  # fmt: skip
        response = _Response(conn, pool.loop)
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
