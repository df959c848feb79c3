"""The replica's HTTP server protocol: uvicorn's httptools protocol, with the writes of one turn of the event loop
sent to the client as one.

uvicorn writes a response's status line and headers as soon as the app starts the response, then each body
message on its own: two ``send`` system calls for a JSON answer of one chunk, where one does. Here the
connection's transport gathers what is written during one turn of the loop and sends it at the end of that turn
(``call_soon``): a response whose first body bytes follow its headers without waiting goes out in one write, and
a stream whose node has not sent its first token yet still gets its headers at once (the next turn).

It also tells the app when the client's connection is lost, through the scope's ``extensions``
(serving/request.py's ``DisconnectHook``), so the request path learns of a client leaving
without a task of its own waiting on ``receive()`` for every request.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from vllm_etcd_proxy.proxy.serving.request import DISCONNECT_EXTENSION, DisconnectHook


class GatheringTransport:
    """A transport that sends what was written in one turn of the loop in one write; everything else is the
    wrapped transport's."""

    __slots__ = ("_transport", "_loop", "_pending", "_planned")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._planned = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        self._pending.append(bytes(data))
        if not self._planned:
            self._planned = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._planned = False
        pending = self._pending
        if not pending:
            return
        self._pending = []
        if not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return sum(map(len, self._pending)) + self._transport.get_write_buffer_size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GatheringHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a ``GatheringTransport``, telling the app of a lost connection (pass the
    class as ``uvicorn.Config(http=...)``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._disconnect = DisconnectHook()
        self._extensions: dict[str, dict[object, object]] = {DISCONNECT_EXTENSION: {"hook": self._disconnect}}
        super().connection_made(GatheringTransport(transport, self.loop))  # type: ignore[arg-type]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = self._extensions

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._disconnect.lost()
