"""Runs an exchange with the nodes and relays the answer to the client over raw ASGI.

Everything after the request body was read happens here, under a watch for the client going away: a
disconnect cancels whatever is in progress (waiting for a node, the prefill leg, relaying a stream), and
closing the upstream response drops the connection to the node, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from starlette.types import Message, Receive, Send

from proxy.errors import ProxyError, render, sse_error_event
from proxy.forwarder import ErrorAnswer, Upstream, client_headers
from proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)

Exchange = Callable[[], Awaitable[Upstream | ErrorAnswer]]


class _DisconnectWatch:
    """Cancels the current task when the client disconnects (after the request body was fully read)."""

    __slots__ = ("_task", "finished", "gone", "_waiter")

    def __init__(self, receive: Receive) -> None:
        self._task = asyncio.current_task()
        self.finished = False
        self.gone = False
        self._waiter: asyncio.Future[Message] = asyncio.ensure_future(receive())
        self._waiter.add_done_callback(self._fire)

    def _fire(self, fut: asyncio.Future[Message]) -> None:
        if fut.cancelled() or fut.exception() is not None or self.finished:
            return
        if fut.result().get("type") == "http.disconnect" and self._task is not None:
            self.gone = True
            self._task.cancel()

    def stop(self) -> None:
        self.finished = True
        self._waiter.remove_done_callback(self._fire)
        self._waiter.cancel()


async def send_error(send: Send, exc: ProxyError, request_id: str | None) -> None:
    status, headers, body = render(exc, request_id)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


class Relay:
    """Runs ``exchange`` (which returns an open upstream response) and streams it to the client."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    async def __call__(self, exchange: Exchange, receive: Receive, send: Send, *, route: str, mode: str,
                       request_id: str, started: float) -> int:  # fmt: skip
        """Returns the HTTP status the client got (499 when it left first)."""
        status = 499
        watch = _DisconnectWatch(receive)
        try:
            status = await self._run(exchange, send, watch, route, mode, request_id, started)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not watch.gone or task is None:
                raise
            task.uncancel()
            self._metrics.client_disconnects.inc()
            log.info("client disconnected request_id=%s route=%s", request_id, route)
        finally:
            watch.stop()
        return status

    async def _run(self, exchange: Exchange, send: Send, watch: _DisconnectWatch, route: str, mode: str,
                   request_id: str, started: float) -> int:  # fmt: skip
        # Before the last body message goes out, the watch is told: once it is sent, uvicorn reports
        # "disconnect" to receive(), which is not a client leaving.
        try:
            answer = await exchange()
        except ProxyError as exc:
            watch.finished = True
            await send_error(send, exc, request_id)
            return exc.status
        if isinstance(answer, ErrorAnswer):
            headers = [*answer.headers, (b"content-length", str(len(answer.body)).encode())]
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            watch.finished = True
            await send({"type": "http.response.body", "body": answer.body})
            return answer.status
        await self._relay(answer, send, watch, route, mode, request_id, started)
        return answer.status

    async def _relay(self, upstream: Upstream, send: Send, watch: _DisconnectWatch, route: str, mode: str,
                     request_id: str, started: float) -> None:  # fmt: skip
        outcome = "cancelled"
        response = upstream.response
        headers = client_headers(response.headers)
        if not any(k.lower() == b"x-request-id" for k, _ in headers):
            headers.append((b"x-request-id", request_id.encode("latin-1", "replace")))
        try:
            await send({"type": "http.response.start", "status": response.status, "headers": headers})
            read = response.read
            chunks = 0
            try:
                chunk = await read()
                if chunk:
                    self._metrics.first_byte(route, mode, started)
                while chunk:
                    chunks += 1
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    chunk = await read()
            except ProxyError as exc:
                # Bytes already reached the client: no retry; tell a stream reader why it ends.
                outcome = "broken"
                log.warning("stream broken request_id=%s error=%s", request_id, exc.message)
                if _is_event_stream(response.headers):
                    watch.finished = True
                    await send({"type": "http.response.body", "body": sse_error_event(exc), "more_body": False})
                # Otherwise leave the response unfinished: the server then drops the connection, so the client
                # sees a truncated answer as an error instead of a complete-looking, cut-off JSON body.
                return
            self._metrics.stream_chunks.inc(chunks)
            watch.finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            outcome = "ok"
        finally:
            upstream.close(outcome)
