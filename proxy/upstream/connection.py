"""One keep-alive HTTP/1.1 connection to a node (an asyncio protocol parsed by httptools) and the response
being read on it. Body bytes that arrived together are handed over together; a response closed before its end
closes its connection at once (that is how vLLM learns to abort)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

import httptools

from vllm_etcd_proxy.proxy.errors import UpstreamFailed, UpstreamTimeout

if TYPE_CHECKING:
    from vllm_etcd_proxy.proxy.upstream.connections import NodeConnections

PAUSE_BYTES = 1 << 20
"""Body bytes buffered for a slow client before the node's connection stops being read."""


class Response:
    """A response being read from one connection; filled in by the connection's parser callbacks."""

    __slots__ = (
        "status",
        "headers",
        "_conn",
        "_loop",
        "_parts",
        "_buffered",
        "_waiter",
        "_error",
        "complete",
        "head_done",
        "last_read",
        "_timer",
        "_idle",
        "bytes_seen",
    )

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop) -> None:
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


class Connection(asyncio.Protocol):
    """One keep-alive connection to a node, carrying one request at a time."""

    def __init__(self, pool: NodeConnections) -> None:
        self._pool = pool
        self._loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
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
        if response.head_done and exc is None and reads_to_close(response.headers):
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

    def finish(self, response: Response) -> None:
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


def reads_to_close(headers: list[tuple[bytes, bytes]]) -> bool:
    return not any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in headers)
