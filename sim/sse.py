"""The streamed response of a generation: Server-Sent Events whose headers wait for the engine and whose
generation stops when the client leaves."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from vllm_etcd_proxy.sim.engine import Engine
from vllm_etcd_proxy.sim.errors import ApiError
from vllm_etcd_proxy.sim.middleware import ClientGone, until_disconnect
from vllm_etcd_proxy.sim.record import Record

CLIENT_CLOSED = 499
"""Recorded status of a request whose client left first (nginx's convention; nothing is sent)."""


class SSEResponse(Response):
    """text/event-stream whose headers go out only once the engine accepts the request (not while hung),
    and whose generation is cancelled the moment the client disconnects."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: Callable[[Callable[[], Awaitable[None]]], AsyncGenerator[str, None]],
        engine: Engine,
        record: Record,
        headers: dict[str, str],
    ):
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self.events = events
        self.engine = engine
        self.record = record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def start() -> None:
            nonlocal started
            started = True
            self.record.status = self.status_code
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def pump() -> None:
            async with aclosing(self.events(start)) as events:
                async for event in events:
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(pump(), receive)
        except (ClientGone, OSError):
            pass
        finally:
            if not started:
                self.record.status = CLIENT_CLOSED
            self.engine.log(self.record)


async def answer_whole(
    engine: Engine,
    record: Record,
    collect: Awaitable[Response],
    receive: Receive,
    on_error: Callable[[ApiError], Response] | None = None,
) -> Response:
    """A non-streamed answer: ``collect`` runs until done or the client leaves (recorded as 499, as vLLM aborts
    the request); an ``ApiError`` it raises is the answer (``on_error`` renders it, vLLM's JSON by default)."""
    try:
        response = await until_disconnect(collect, receive)
    except ClientGone:
        response = Response(status_code=CLIENT_CLOSED)
    except ApiError as exc:
        response = on_error(exc) if on_error is not None else JSONResponse(exc.body(), status_code=exc.status)
    record.status = response.status_code
    engine.log(record)
    return response
