"""One proxied request, from the ASGI entry to the relay: what every layer and flow reads and writes.

As uvicorn's ``RequestResponseCycle``, one object holds a request's state as attributes instead of values
repacked into closures, tuples and parameter lists at every step. Each layer (layers.py) fills in what it finds
out (the key's limits, the body and model, the flow) and the relay (relay.py) what it saw of the answer. The
object lives for one request and is never shared between tasks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive, Scope, Send

from vllm_etcd_proxy.proxy.errors import ANTHROPIC_ROUTE, ProxyError, render, sse_error_event
from vllm_etcd_proxy.proxy.serving.routes import Kind
from vllm_etcd_proxy.proxy.serving.usage import usage_of
from vllm_etcd_proxy.proxy.serving.wsrelay import Denied, reason_text
from vllm_etcd_proxy.proxy.telemetry.spans import NO_TRACE, RequestTrace

if TYPE_CHECKING:
    from vllm_etcd_proxy.fleet.adapters import Adapter
    from vllm_etcd_proxy.proxy.discovery.pool import NodeState
    from vllm_etcd_proxy.proxy.kvcache.prompt.ids import KvPrompt
    from vllm_etcd_proxy.proxy.routing.elastic import Plan
    from vllm_etcd_proxy.proxy.serving.flows import Flow
    from vllm_etcd_proxy.proxy.serving.parsing import ClientRequest
    from vllm_etcd_proxy.proxy.tenancy.admission import Ticket
    from vllm_etcd_proxy.proxy.tenancy.keys import Limits


log = logging.getLogger(__name__)

DISCONNECT_EXTENSION = "vllm_proxy.disconnect"
"""The scope's ``extensions`` key under which our HTTP server (httpserver.py) gives a request its connection's
``DisconnectHook`` (``{"hook": ...}``; absent under another server)."""


class DisconnectHook:
    """Calls back once when the client's connection is lost, for the request being answered on it."""

    __slots__ = ("_callback",)

    def __init__(self) -> None:
        self._callback: Callable[[], None] | None = None

    def watch(self, callback: Callable[[], None]) -> None:
        self._callback = callback

    def unwatch(self) -> None:
        self._callback = None

    def lost(self) -> None:
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


class Tally:
    """What the relay saw of one answer, for the per-model metrics, the trace and the tenant's tokens: written a
    few times per request (first byte, end), never per chunk."""

    __slots__ = ("first_at", "chunks", "tail", "streamed")

    def __init__(self) -> None:
        self.first_at: float | None = None
        """``time.monotonic()`` when the first body byte went to the client."""
        self.chunks = 0
        """Body writes to the client."""
        self.tail = b""
        """The answer's last bytes, where vLLM puts ``usage``."""
        self.streamed = False


class ProxyRequest:
    """One client request on its way to a node and back; see the module docstring."""

    __slots__ = (
        "scope",
        "receive",
        "send",
        "path",
        "kind",
        "route",
        "started",
        "client",
        "forwarded",
        "trace",
        "limits",
        "ticket",
        "raw",
        "body",
        "model",
        "target",
        "head",
        "method",
        "affinity",
        "uncached_tokens",
        "prompt",
        "pinned",
        "plan",
        "adapter",
        "flow",
        "mode",
        "resumable",
        "tally",
        "status",
        "error",
        "responded",
        "event_stream",
        "denied",
        "finished",
        "gone",
        "_usage",
        "_task",
        "_waiter",
        "_hook",
    )

    def __init__(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        kind: Kind,
        route: str,
        started: float,
        client: ClientRequest,
    ) -> None:
        self.scope, self.receive, self.send = scope, receive, send
        self.path: str = scope["path"]
        self.kind = kind
        self.route = route
        """The path as metrics name it (bounded label values)."""
        self.started = started
        """``time.monotonic()`` when it arrived."""
        self.client = client
        self.forwarded = client.forwarded
        """Headers for the nodes (the tracing layer takes the client's trace context out)."""
        self.trace: RequestTrace = NO_TRACE
        self.limits: Limits | None = None
        """The client key's tenant and limits (None: no key set is configured)."""
        self.ticket: Ticket | None = None
        """Its claim on its tenant's limits (tenancy/admission.py), from the ``TenantLimits`` layer on."""
        self.raw = b""
        """The body as the nodes get it (a continuation's, once a stream is resumed)."""
        self.body: dict[str, Any] | None = None
        """``raw`` parsed, when it is a JSON object."""
        self.model: str | None = None
        self.target = b""
        """Path and query for the nodes."""
        self.head = b""
        """Header lines for the nodes, each ending in CRLF."""
        self.method = b"POST"
        self.affinity: str | None = None
        """The key an affinity policy routes by (session, user or prompt prefix)."""
        self.uncached_tokens: int | None = None
        """Prompt tokens no node has seen, as far as the replica knows (``--pd-min-prompt-tokens``)."""
        self.prompt: KvPrompt | None = None
        """The prompt's token ids for kv-aware routing (None: unknown, or no node publishes KV events)."""
        self.pinned: NodeState | None = None
        """The one node the request may go to (it holds the response the request names)."""
        self.plan: Plan | None = None
        """For a model with ``both`` nodes: run on one node, or the nodes of its split (routing/elastic.py)."""
        self.adapter: Adapter | None = None
        """The registered LoRA adapter the request names."""
        self.flow: Flow | None = None
        self.mode = "none"
        """The flow's name in metrics: mixed, decode, disagg, local, split, pinned (none: refused before one was
        picked)."""
        self.resumable = False
        """Its stream may go on from another node when its node fails (resume.py)."""
        self.tally: Tally | None = None
        """Kept for completions and chat completions only."""
        self.status = 499
        """What the client got (499: it left first)."""
        self.error: ProxyError | None = None
        self.responded = False
        """The answer's status and headers went out (``respond``): a later refusal can only end it."""
        self.event_stream = False
        """The answer is an event stream (an error after its headers can still be told as an event)."""
        self.denied: Denied | None = None
        """Why a session's handshake was refused (its outcome for the session metrics)."""
        self.finished = False
        """The last body message is (being) sent: uvicorn reports "disconnect" after it, which is no client
        leaving. Set by ``send_last`` alone."""
        self.gone = False
        """The client disconnected while the answer was on its way."""
        self._usage: tuple[int | None, int | None] | None = None
        self._task: asyncio.Task[Any] | None = None
        self._waiter: asyncio.Future[Message] | None = None
        self._hook: DisconnectHook | None = None

    @property
    def request_id(self) -> str:
        return self.client.request_id

    # -- answering ----------------------------------------------------------------------------------------------

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the answer's status and headers (once)."""
        self.status, self.responded = status, True
        self.event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def refuse(self, exc: ProxyError) -> None:
        """Answer ``exc`` (the request reached no node, or none answered); once the answer's headers went out,
        end it instead (``broken``). A session is denied its handshake (``deny``)."""
        self.error = exc
        if self.kind is Kind.SESSION:
            await self.deny(Denied.of(exc, self.request_id))
            return
        if self.responded:
            await self.broken(exc)
            return
        status, headers, body = render(exc, self.request_id, anthropic=self.route == ANTHROPIC_ROUTE)
        await self.respond(status, headers)
        await self.send_last(body)

    async def deny(self, denied: Denied) -> None:
        """Refuse a session's handshake: an HTTP answer where the server can send one, else a close (which the
        client sees as HTTP 403)."""
        self.status, self.denied = denied.answer[0], denied
        if "websocket.http.response" in self.scope.get("extensions", {}):
            status, headers, body = denied.answer
            await self.send({"type": "websocket.http.response.start", "status": status, "headers": headers})
            await self.send({"type": "websocket.http.response.body", "body": body})
        else:
            await self.send({"type": "websocket.close", "code": denied.code, "reason": reason_text(denied.message)})

    async def broken(self, exc: ProxyError) -> None:
        """The answer failed after its headers went out: a stream is told why in an error event and ended; any
        other answer is left unfinished, so the server drops the connection and the client sees a truncated
        answer as an error rather than a complete-looking, cut-off body."""
        log.warning("stream broken request_id=%s error=%s", self.request_id, exc.message)
        if self.event_stream and not self.finished:
            await self.send_last(sse_error_event(exc, anthropic=self.route == ANTHROPIC_ROUTE))

    async def send_body(self, body: bytes) -> None:
        await self.send({"type": "http.response.body", "body": body, "more_body": True})

    async def send_last(self, body: bytes = b"") -> None:
        """The answer's last body message; the disconnect watch stops first."""
        self.finished = True
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    def usage(self) -> tuple[int | None, int | None]:
        """The answer's (prompt, completion) tokens from its ``usage``, where it was a 200 with one."""
        if self._usage is None:
            tally = self.tally
            ok = self.status == 200 and tally is not None and tally.tail and self.model is not None
            self._usage = usage_of(tally.tail) if ok and tally is not None else (None, None)
        return self._usage

    # -- the client leaving -------------------------------------------------------------------------------------

    def watch_disconnect(self) -> None:
        """Cancel the current task when the client disconnects (call once the request body was read whole). Our
        server says so itself (httpserver.py); under another, a task waits on ``receive()``."""
        self._task = asyncio.current_task()
        extensions = self.scope.get("extensions")
        given = extensions.get(DISCONNECT_EXTENSION) if extensions else None
        hook = given.get("hook") if given else None
        if isinstance(hook, DisconnectHook):
            self._hook = hook
            hook.watch(self._on_lost)
            return
        self._waiter = waiter = asyncio.ensure_future(self.receive())
        waiter.add_done_callback(self._on_receive)

    def _on_lost(self) -> None:
        if not self.finished and self._task is not None:
            self.gone = True
            self._task.cancel()

    def _on_receive(self, fut: asyncio.Future[Message]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        if fut.result().get("type") == "http.disconnect":
            self._on_lost()

    def stop_watching(self) -> None:
        if self._hook is not None:
            self._hook.unwatch()
        elif self._waiter is not None:
            self._waiter.remove_done_callback(self._on_receive)
            self._waiter.cancel()
