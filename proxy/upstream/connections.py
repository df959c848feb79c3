"""The connections to one node: idle ones on a stack, reused most-recent-first (no scan per request; the least
recently used are the ones that expire, so a stale connection is never tried before a fresh one), and a cap on
how many are open."""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_etcd_proxy.fleet.tls import TLS_HINT, ssl_reason
from vllm_etcd_proxy.proxy.errors import UpstreamFailed, UpstreamTimeout
from vllm_etcd_proxy.proxy.upstream.connection import Connection

if TYPE_CHECKING:
    from vllm_etcd_proxy.proxy.upstream.transport import Origin

KEEPALIVE_SECONDS = 4.0
"""Idle connections older than this are closed, not reused: vLLM's server (uvicorn) closes them after 5 s."""


class NodeConnections:
    """The connections to one node: idle ones on a stack, a cap on how many are open."""

    def __init__(
        self,
        origin: Origin,
        loop: asyncio.AbstractEventLoop,
        limit: int,
        connect_timeout: float,
        ssl_context: Callable[[], ssl.SSLContext],
    ) -> None:
        self.origin = origin
        self.name = f"{origin.host}:{origin.port}"
        self.loop = loop
        self._limit = limit
        self._connect_timeout = connect_timeout
        self._ssl_context = ssl_context
        self._idle: list[Connection] = []
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def open(self) -> int:
        return self._open

    def take_idle(self) -> Connection | None:
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

    async def connect(self, wait: float) -> Connection:
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
                raise UpstreamTimeout(
                    f"node {self.name}: all {self._limit} connections stayed busy for {wait:g} s"
                ) from None
        self._open += 1
        conn = Connection(self)
        try:
            await self._open_connection(conn)
        except BaseException:
            self._forget(conn)
            raise
        return conn

    async def _open_connection(self, conn: Connection) -> None:
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
            raise UpstreamTimeout(f"node {self.name}: no connection within {self._connect_timeout:g} s") from None
        except ssl.SSLError as exc:  # before OSError, which it is: the message says what to check
            raise UpstreamFailed(f"node {self.name}: TLS failed ({ssl_reason(exc)}); {TLS_HINT}") from None
        except OSError as exc:
            raise UpstreamFailed(f"node {self.name}: cannot connect ({exc.strerror or type(exc).__name__})") from None

    def _forget(self, conn: Connection) -> None:
        if not conn.closed:
            conn.closed = True
            if conn.transport is not None:
                conn.transport.close()
            self.lost(conn)

    def give_back(self, conn: Connection) -> None:
        conn.idle_since = self.loop.time()
        self._idle.append(conn)
        self._wake_one()

    def lost(self, conn: Connection) -> None:
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
