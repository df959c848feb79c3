"""The ASGI response that runs an exchange with the nodes and relays the answer to the client.

Everything after the request body was read happens here, under a watch for the client going away: a
disconnect cancels whatever is in progress (waiting for a node, the prefill leg, relaying a stream), and
closing the upstream response drops the connection to the node, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from proxy.errors import ProxyError
from proxy.forwarder import ErrorAnswer, Upstream, client_headers
from proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)

Exchange = Callable[[], Awaitable[Upstream | ErrorAnswer]]


class ClientGone(Exception):
    """The client disconnected; nothing more can be sent."""


class _DisconnectWatch:
    """Cancels the current task when the client disconnects (after the request body was fully read)."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task = asyncio.current_task()
        self.finished = False
        self.gone = False
        self._waiter: asyncio.Future[Message] | None = None

    def __enter__(self) -> _DisconnectWatch:
        self._waiter = asyncio.ensure_future(self._receive())
        self._waiter.add_done_callback(self._fire)
        return self

    def _fire(self, fut: asyncio.Future[Message]) -> None:
        if fut.cancelled() or fut.exception() is not None or self.finished:
            return
        if fut.result().get("type") == "http.disconnect" and self._task is not None:
            self.gone = True
            self._task.cancel()

    def __exit__(self, *exc: object) -> None:
        self.finished = True
        if self._waiter is not None:
            self._waiter.remove_done_callback(self._fire)
            self._waiter.cancel()


class RelayResponse(Response):
    """Runs ``exchange`` (which returns an open upstream response) and streams it to the client."""

    def __init__(
        self,
        exchange: Exchange,
        *,
        route: str,
        mode: str,
        request_id: str,
        metrics: ProxyMetrics,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self._exchange = exchange
        self._on_done = on_done
        self._route = route
        self._mode = mode
        self._request_id = request_id
        self._metrics = metrics
        self._started = time.monotonic()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = 499
        watch = _DisconnectWatch(receive)

        async def send_watched(message: Message) -> None:
            # Once the last body message is out, uvicorn reports "disconnect" to receive(): not a client leaving.
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                watch.finished = True
            await send(message)

        try:
            with watch:
                status = await self._run(send_watched)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not watch.gone or task is None:
                raise
            task.uncancel()
            self._metrics.client_disconnects.inc()
            log.info("client disconnected request_id=%s route=%s", self._request_id, self._route)
        finally:
            if self._on_done is not None:
                self._on_done()
            self._metrics.requests.labels(self._route, self._mode, str(status)).inc()
            self._metrics.request_seconds.labels(self._route, self._mode).observe(time.monotonic() - self._started)

    async def _run(self, send: Send) -> int:
        try:
            answer = await self._exchange()
        except ProxyError as exc:
            await send_error(send, exc, self._request_id)
            return exc.status
        if isinstance(answer, ErrorAnswer):
            headers = [*answer.headers, (b"content-length", str(len(answer.body)).encode())]
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            await send({"type": "http.response.body", "body": answer.body})
            return answer.status
        await self._relay(answer, send)
        return answer.status

    async def _relay(self, upstream: Upstream, send: Send) -> None:
        outcome = "cancelled"
        streaming = upstream.response.headers.get("content-type", "").startswith("text/event-stream")
        headers = client_headers(upstream.response)
        if "x-request-id" not in upstream.response.headers:
            headers.append((b"x-request-id", self._request_id.encode("latin-1", "replace")))
        try:
            await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
            first = True
            chunks = 0
            try:
                async for chunk in upstream.chunks():
                    if first:
                        first = False
                        self._metrics.first_byte_seconds.labels(self._route, self._mode).observe(
                            time.monotonic() - self._started
                        )
                    chunks += 1
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except ProxyError as exc:
                # Bytes already reached the client: no retry; tell a stream reader why it ends.
                outcome = "broken"
                log.warning("stream broken request_id=%s error=%s", self._request_id, exc.message)
                if streaming:
                    event = b"data: " + json.dumps(exc.body()).encode() + b"\n\ndata: [DONE]\n\n"
                    await send({"type": "http.response.body", "body": event, "more_body": False})
                # Otherwise leave the response unfinished: the server then drops the connection, so the client
                # sees a truncated answer as an error instead of a complete-looking, cut-off JSON body.
                return
            self._metrics.stream_chunks.inc(chunks)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            outcome = "ok"
        finally:
            # Shielded: a cancelled client must still close the node's connection (that aborts the request).
            await asyncio.shield(upstream.aclose(outcome))


async def send_error(send: Send, exc: ProxyError, request_id: str) -> None:
    body = json.dumps(exc.body()).encode()
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode("latin-1", "replace")),
    ]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
