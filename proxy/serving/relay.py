"""Runs a request's flow and relays the node's answer to the client over raw ASGI.

Everything after the request body was read happens here, under a watch for the client going away: a
disconnect cancels whatever is in progress (waiting for a node, the prefill leg, relaying a stream), and
closing the upstream response drops the connection to the node, which makes vLLM abort the request. The relay
keeps its state on the request (``ProxyRequest``): the status, the tally of what it sent, the disconnect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import orjson

from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.errors import ProxyError, UpstreamFailed, sse_error_event
from vllm_etcd_proxy.proxy.serving.flows import Flows
from vllm_etcd_proxy.proxy.serving.forwarder import ErrorAnswer, Upstream, client_headers
from vllm_etcd_proxy.proxy.serving.request import ProxyRequest
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


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


class Relay:
    """Opens the request's flow (``request.flow``) and streams the answer to the client."""

    def __init__(self, metrics: ProxyMetrics, flows: Flows, max_resumes: int) -> None:
        self._metrics = metrics
        self._flows = flows
        self._max_resumes = max_resumes

    async def __call__(self, request: ProxyRequest) -> None:
        """Sets ``request.status`` to what the client got (499 when it left first)."""
        request.watch_disconnect()
        try:
            await self._run(request)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not request.gone or task is None:
                raise
            task.uncancel()
            request.status = 499
            self._metrics.client_disconnects.inc()
            log.info("client disconnected request_id=%s route=%s", request.request_id, request.route)
        finally:
            request.stop_watching()

    async def _run(self, request: ProxyRequest) -> None:
        assert request.flow is not None
        try:
            answer = await request.flow.open(request)
        except ProxyError as exc:
            await request.refuse(exc)
            return
        if isinstance(answer, ErrorAnswer):
            headers = [*answer.headers, (b"content-length", str(len(answer.body)).encode())]
            await request.respond(answer.status, headers)
            await request.send_last(answer.body)
            return
        request.status = answer.status
        if request.resumable and answer.status == 200 and _is_event_stream(answer.headers):
            await self._relay_resumable(request, answer)
        else:
            await self._relay(request, answer)

    @staticmethod
    async def _start(request: ProxyRequest, upstream: Upstream) -> None:
        headers = client_headers(upstream.headers)
        if not any(k.lower() == b"x-request-id" for k, _ in headers):
            headers.append((b"x-request-id", request.request_id.encode("latin-1", "replace")))
        await request.respond(upstream.status, headers)

    async def _relay(self, request: ProxyRequest, upstream: Upstream) -> None:
        """Each chunk to the client as it comes; except that an answer that is not a stream keeps its latest
        chunk until the next is in, so its last one goes out as the response's last message (one ASGI message
        fewer for a JSON answer, which a node sends in one piece; its client can read nothing before its end)."""
        outcome = "cancelled"
        response = upstream.response
        streamed = _is_event_stream(response.headers)
        try:
            await self._start(request, upstream)
            read, send_body = response.read, request.send_body
            chunks = 0
            before = last = held = b""
            try:
                chunk = await read()
                if chunk:
                    self._first_byte(request, upstream)
                while chunk:
                    chunks += 1
                    if streamed:
                        await send_body(chunk)
                    elif held:
                        await send_body(held)
                    held = chunk
                    before, last = last, chunk
                    chunk = await read()
            except ProxyError as exc:
                outcome = "broken"
                await request.broken(exc)
                return
            self._metrics.chunks(chunks)
            if request.tally is not None:
                tally = request.tally
                tally.chunks, tally.tail, tally.streamed = chunks, before + last, streamed
            await request.send_last(b"" if streamed else held)
            outcome = "ok"
        finally:
            upstream.close(outcome)

    def _first_byte(self, request: ProxyRequest, upstream: Upstream) -> None:
        now = self._metrics.first_byte(request.route, request.mode, request.started)
        if request.tally is not None:
            request.tally.first_at = now
        upstream.span.first_byte()

    # -- streams that go on from another node (resume.py) --------------------------------------------------------

    async def _relay_resumable(self, request: ProxyRequest, upstream: Upstream) -> None:
        """Relay an SSE answer event by event; when its node fails, go on from another node."""
        assert request.body is not None
        original: Mapping[str, Any] = request.body
        sent = StreamLog()
        splice: Splice | None = None
        current, resumes = upstream, 0
        await self._start(request, upstream)
        while (failure := await self._pump_until_failure(request, current, sent, splice)) is not None and not sent.done:
            sent.drop_partial()
            if resumes >= self._max_resumes:
                self._metrics.resume("exhausted")
                await self._give_up(request, failure, f"after {resumes} resumes")
                return
            done = progress(request.path, sent)
            body = continuation_body(request.path, original, done)
            if body is None:
                self._ended_by_us(request, current.state, failure)
                await request.send_body(DONE)
                break
            resumes += 1
            answer = await self._resume(request, body, current.state, failure)
            if answer is None:
                return
            log.warning(
                "stream resumed request_id=%s from=%s to=%s tokens_sent=%d resume=%d reason=%s",
                request.request_id,
                current.state.node.node_id,
                answer.state.node.node_id,
                done.tokens,
                resumes,
                failure.message,
            )
            current, splice = answer, Splice(request.path, done)
        self._metrics.chunks(sent.writes)
        if request.tally is not None:
            request.tally.chunks, request.tally.tail, request.tally.streamed = sent.writes, sent.tail(), True
        await request.send_last()

    async def _pump_until_failure(
        self, request: ProxyRequest, upstream: Upstream, sent: StreamLog, splice: Splice | None
    ) -> ProxyError | None:
        """Relay ``upstream`` to its end; the failure that cut it short, if any."""
        outcome, failure = "cancelled", None
        try:
            await self._pump(request, upstream, sent, splice)
            outcome = "ok"
        except ProxyError as exc:
            outcome, failure = "broken", exc
        finally:
            upstream.close(outcome)
        return failure

    def _ended_by_us(self, request: ProxyRequest, failed: NodeState, failure: ProxyError) -> None:
        """The node failed after the answer's last token: the proxy ends the stream itself."""
        self._metrics.resume("completed")
        log.warning(
            "stream's node failed after its last token request_id=%s node=%s error=%s; ended by the proxy "
            "(without the node's usage chunk)",
            request.request_id,
            failed.node.node_id,
            failure.message,
        )

    async def _resume(
        self, request: ProxyRequest, body: dict[str, Any], failed: NodeState, failure: ProxyError
    ) -> Upstream | None:
        """The continuation ``body`` opened through the normal routing, avoiding the node that ``failed``; None
        when it could not go on (the client was told why)."""
        request.trace.resumed()
        request.raw, request.body = orjson.dumps(body), body
        try:
            answer: Upstream | ErrorAnswer | None = await self._flows.pick(request, (failed,)).open(request, (failed,))
        except ProxyError as exc:
            answer, failure = None, exc
        if isinstance(answer, Upstream) and answer.status == 200:
            self._metrics.resume("resumed")
            return answer
        if isinstance(answer, Upstream):
            answer.close("refused")  # an answer, not a failure of the node, and not a success either
        if answer is not None:
            failure = UpstreamFailed(f"the continuation was refused with status {answer.status}")
        self._metrics.resume("failed")
        await self._give_up(request, failure, "and could not be resumed")
        return None

    @staticmethod
    async def _give_up(request: ProxyRequest, failure: ProxyError, how: str) -> None:
        log.warning("stream broken request_id=%s error=%s %s", request.request_id, failure.message, how)
        await request.send_last(sse_error_event(failure))

    async def _pump(self, request: ProxyRequest, upstream: Upstream, sent: StreamLog, splice: Splice | None) -> None:
        """Relay whole events until ``[DONE]`` and the end of the body; raise ``ProxyError`` when the node fails."""
        read, cut, add = upstream.response.read, sent.cut, sent.add
        first = splice is None
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
                    self._first_byte(request, upstream)
                add(events)
                await request.send_body(events)
            if failed is not None:
                raise failed
