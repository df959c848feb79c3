"""Runs an exchange with the nodes and relays the answer to the client over raw ASGI.

Everything after the request body was read happens here, under a watch for the client going away: a
disconnect cancels whatever is in progress (waiting for a node, the prefill leg, relaying a stream), and
closing the upstream response drops the connection to the node, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple

from starlette.types import Message, Receive, Send

from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.errors import ANTHROPIC_ROUTE, ProxyError, UpstreamFailed, render, sse_error_event
from vllm_etcd_proxy.proxy.serving.forwarder import ErrorAnswer, Upstream, client_headers
from vllm_etcd_proxy.proxy.serving.resume import (
    DONE,
    NodeErrorEvent,
    Splice,
    StreamLog,
    continuation_body,
    error_event_at,
    progress,
)
from vllm_etcd_proxy.proxy.telemetry.metrics import ProxyMetrics

log = logging.getLogger(__name__)

Exchange = Callable[[], Awaitable[Upstream | ErrorAnswer]]
Reopen = Callable[[dict[str, Any], tuple[NodeState, ...]], Awaitable[Upstream | ErrorAnswer]]
"""Sends a continuation body through the normal routing, avoiding the given nodes where it can."""


class ResumePlan(NamedTuple):
    """How a resumable stream goes on elsewhere when its node fails (resume.py)."""

    path: str
    body: Mapping[str, Any]
    reopen: Reopen
    max_resumes: int


class Tally:
    """What the relay saw of one answer, for the per-model metrics and the trace: written a few times per
    request (first byte, end), never per chunk."""

    __slots__ = ("first_at", "chunks", "tail", "streamed")

    def __init__(self) -> None:
        self.first_at: float | None = None
        """``time.monotonic()`` when the first body byte went to the client."""
        self.chunks = 0
        """Body writes to the client."""
        self.tail = b""
        """The answer's last bytes, where vLLM puts ``usage``."""
        self.streamed = False


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


async def send_error(send: Send, exc: ProxyError, request_id: str | None, *, route: str = "") -> None:
    status, headers, body = render(exc, request_id, anthropic=route == ANTHROPIC_ROUTE)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


class Relay:
    """Runs ``exchange`` (which returns an open upstream response) and streams it to the client."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    async def __call__(
        self,
        exchange: Exchange,
        receive: Receive,
        send: Send,
        *,
        route: str,
        mode: str,
        request_id: str,
        started: float,
        plan: ResumePlan | None = None,
        tally: Tally | None = None,
    ) -> int:
        """Returns the HTTP status the client got (499 when it left first)."""
        status = 499
        watch = _DisconnectWatch(receive)
        try:
            status = await self._run(exchange, send, watch, route, mode, request_id, started, plan, tally)
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

    async def _run(
        self,
        exchange: Exchange,
        send: Send,
        watch: _DisconnectWatch,
        route: str,
        mode: str,
        request_id: str,
        started: float,
        plan: ResumePlan | None,
        tally: Tally | None,
    ) -> int:
        # Before the last body message goes out, the watch is told: once it is sent, uvicorn reports
        # "disconnect" to receive(), which is not a client leaving.
        try:
            answer = await exchange()
        except ProxyError as exc:
            watch.finished = True
            await send_error(send, exc, request_id, route=route)
            return exc.status
        if isinstance(answer, ErrorAnswer):
            headers = [*answer.headers, (b"content-length", str(len(answer.body)).encode())]
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            watch.finished = True
            await send({"type": "http.response.body", "body": answer.body})
            return answer.status
        if plan is not None and answer.status == 200 and _is_event_stream(answer.headers):
            await self._relay_resumable(answer, send, watch, route, mode, request_id, started, plan, tally)
        else:
            await self._relay(answer, send, watch, route, mode, request_id, started, tally)
        return answer.status

    @staticmethod
    async def _start(upstream: Upstream, send: Send, request_id: str) -> None:
        headers = client_headers(upstream.headers)
        if not any(k.lower() == b"x-request-id" for k, _ in headers):
            headers.append((b"x-request-id", request_id.encode("latin-1", "replace")))
        await send({"type": "http.response.start", "status": upstream.status, "headers": headers})

    async def _relay(
        self,
        upstream: Upstream,
        send: Send,
        watch: _DisconnectWatch,
        route: str,
        mode: str,
        request_id: str,
        started: float,
        tally: Tally | None,
    ) -> None:
        outcome = "cancelled"
        response = upstream.response
        try:
            await self._start(upstream, send, request_id)
            read = response.read
            chunks = 0
            before = last = b""
            try:
                chunk = await read()
                if chunk:
                    self._first_byte(upstream, route, mode, started, tally)
                while chunk:
                    chunks += 1
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    before, last = last, chunk
                    chunk = await read()
            except ProxyError as exc:
                # Bytes already reached the client: no retry; tell a stream reader why it ends.
                outcome = "broken"
                log.warning("stream broken request_id=%s error=%s", request_id, exc.message)
                if _is_event_stream(response.headers):
                    watch.finished = True
                    event = sse_error_event(exc, anthropic=route == ANTHROPIC_ROUTE)
                    await send({"type": "http.response.body", "body": event, "more_body": False})
                # Otherwise leave the response unfinished: the server then drops the connection, so the client
                # sees a truncated answer as an error instead of a complete-looking, cut-off JSON body.
                return
            self._metrics.stream_chunks.inc(chunks)
            if tally is not None:
                tally.chunks, tally.tail = chunks, before + last
                tally.streamed = _is_event_stream(response.headers)
            watch.finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            outcome = "ok"
        finally:
            upstream.close(outcome)

    def _first_byte(self, upstream: Upstream, route: str, mode: str, started: float, tally: Tally | None) -> None:
        now = self._metrics.first_byte(route, mode, started)
        if tally is not None:
            tally.first_at = now
        if upstream.span is not None:
            upstream.span.first_byte()

    async def _relay_resumable(
        self,
        upstream: Upstream,
        send: Send,
        watch: _DisconnectWatch,
        route: str,
        mode: str,
        request_id: str,
        started: float,
        plan: ResumePlan,
        tally: Tally | None,
    ) -> None:
        """Relay an SSE answer event by event; when its node fails, go on from another node (resume.py)."""
        sent = StreamLog()
        splice: Splice | None = None
        current = upstream
        resumes = 0
        await self._start(upstream, send, request_id)
        while True:
            outcome = "cancelled"
            failure: ProxyError | None = None
            try:
                await self._pump(current, send, sent, splice, route, mode, started, tally)
                outcome = "ok"
            except ProxyError as exc:
                outcome, failure = "broken", exc
            finally:
                current.close(outcome)
            if failure is None or sent.done:
                break
            sent.drop_partial()
            failed_node = current.state.node.node_id
            if resumes >= plan.max_resumes:
                self._metrics.resume("exhausted")
                log_stream_broken(request_id, failure, f"after {resumes} resumes")
                watch.finished = True
                await send({"type": "http.response.body", "body": sse_error_event(failure), "more_body": False})
                return
            done = progress(plan.path, sent)
            body = continuation_body(plan.path, plan.body, done)
            if body is None:  # the answer was complete but for its end
                self._metrics.resume("completed")
                log.warning(
                    "stream's node failed after its last token request_id=%s node=%s error=%s; ended by "
                    "the proxy (without the node's usage chunk)",
                    request_id,
                    failed_node,
                    failure.message,
                )
                await send({"type": "http.response.body", "body": DONE, "more_body": True})
                break
            resumes += 1
            try:
                answer = await plan.reopen(body, (current.state,))
            except ProxyError as exc:
                answer, failure = None, exc
            if not isinstance(answer, Upstream) or answer.status != 200:
                if isinstance(answer, Upstream):
                    answer.close("refused")  # an answer, not a failure of the node, and not a success either
                    failure = UpstreamFailed(f"the continuation was refused with status {answer.status}")
                elif isinstance(answer, ErrorAnswer):
                    failure = UpstreamFailed(f"the continuation was refused with status {answer.status}")
                self._metrics.resume("failed")
                log_stream_broken(request_id, failure, "and could not be resumed")
                watch.finished = True
                await send({"type": "http.response.body", "body": sse_error_event(failure), "more_body": False})
                return
            self._metrics.resume("resumed")
            log.warning(
                "stream resumed request_id=%s from=%s to=%s tokens_sent=%d resume=%d reason=%s",
                request_id,
                failed_node,
                answer.state.node.node_id,
                done.tokens,
                resumes,
                failure.message,
            )
            splice = Splice(plan.path, done)
            current = answer
        self._metrics.stream_chunks.inc(sent.writes)
        if tally is not None:
            tally.chunks, tally.tail, tally.streamed = sent.writes, sent.tail(), True
        watch.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(
        self,
        upstream: Upstream,
        send: Send,
        sent: StreamLog,
        splice: Splice | None,
        route: str,
        mode: str,
        started: float,
        tally: Tally | None,
    ) -> None:
        """Relay whole events until ``[DONE]`` and the end of the body; raise ``ProxyError`` when the node fails."""
        read, cut, add = upstream.response.read, sent.cut, sent.add
        first = started > 0 and splice is None
        while True:
            chunk = await read()
            if not chunk:
                if sent.done:
                    return
                raise UpstreamFailed(f"node {upstream.state.node.node_id} ended the stream before [DONE]")
            events = cut(chunk)
            if not events:
                continue
            failed: ProxyError | None = None
            if splice is not None:
                events = splice(events)
                failed = splice.failed
            else:
                at = error_event_at(events)
                if at >= 0:
                    events, failed = events[:at], NodeErrorEvent("the node reported an error in the stream")
            if events:
                if first:
                    first = False
                    self._first_byte(upstream, route, mode, started, tally)
                add(events)
                await send({"type": "http.response.body", "body": events, "more_body": True})
            if failed is not None:
                raise failed


def log_stream_broken(request_id: str, error: ProxyError, how: str) -> None:
    log.warning("stream broken request_id=%s error=%s %s", request_id, error.message, how)
