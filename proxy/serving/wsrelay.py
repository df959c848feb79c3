"""One accepted WebSocket connection, relayed message by message between the client (ASGI) and a node (the
``websockets`` client): text stays text, bytes stay bytes, and whichever side closes first closes the other with
its code and reason. A session whose model was not in the query may move, on the client's first message, to a
node serving the model that message names (see sessions.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import Message, Receive, Send
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.errors import ProxyError, render
from vllm_etcd_proxy.proxy.telemetry.spans import LegSpan

_SENDABLE = frozenset([1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014])
CLOSE_TIMEOUT = 5.0
"""Seconds a closing handshake with a node may take."""
_MAX_ROUTING_EVENT = 64 * 1024
"""A first message longer than this is forwarded unread (audio, not a session.update)."""
_CLOSE_CODES = {401: 1008, 404: 1008, 429: 1013, 503: 1013}
_OUTCOMES = {401: "unauthorized", 404: "model_not_found", 429: "rate_limited", 503: "no_node"}
_OUTCOMES_BY_CODE = {"service_unavailable": "replica_full"}
"""503s that are not about nodes: the replica's --max-concurrent-requests."""


class Denied(Exception):
    """The session cannot go on: ``answer`` (status, headers, body) before accept, a close with ``code`` after."""

    def __init__(self, outcome: str, code: int, message: str, answer: tuple[int, list[tuple[bytes, bytes]], bytes]):
        super().__init__(message)
        self.outcome, self.code, self.message, self.answer = outcome, code, message, answer

    @classmethod
    def of(cls, exc: ProxyError | Denied, request_id: str) -> Denied:
        if isinstance(exc, Denied):
            return exc
        return cls(
            _OUTCOMES_BY_CODE.get(exc.code) or _OUTCOMES.get(exc.status, "upstream_failed"),
            _CLOSE_CODES.get(exc.status, 1011),
            exc.message,
            render(exc, request_id),
        )


@dataclass(eq=False)
class Link:
    """The connection to one node."""

    ws: ClientConnection
    state: NodeState
    role: Role
    span: LegSpan
    skip_created: bool = False
    """Drop the node's first message if it is a ``session.created`` (the client has one from an earlier node)."""
    retired: bool = False
    """Replaced by another node's link: its end is not the session's."""


def reason_text(text: str) -> str:
    """A close reason fits in 123 bytes of UTF-8."""
    return text.encode()[:123].decode(errors="ignore")


def _sendable(code: int | None, fallback: int) -> int:
    """``code`` if it may be sent in a close frame (1005, 1006, 1015 only describe a close), else ``fallback``."""
    return code if code is not None and (code in _SENDABLE or 3000 <= code <= 4999) else fallback


def _event_model(text: str) -> str | None:
    """The model a client's JSON event names, if any."""
    if len(text) > _MAX_ROUTING_EVENT or not text.lstrip().startswith("{"):
        return None
    try:
        event = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(event, dict):
        return None
    model = event.get("model")
    session = event.get("session")
    if model is None and event.get("type") == "session.update" and isinstance(session, dict):
        model = session.get("model")
    return model if isinstance(model, str) and model else None


def _is_session_created(message: str | bytes) -> bool:
    with contextlib.suppress(orjson.JSONDecodeError):
        event = orjson.loads(message)
        return isinstance(event, dict) and event.get("type") == "session.created"
    return False


class Session:
    """One accepted connection: two pumps, and whichever side ends first closes the other."""

    def __init__(
        self,
        receive: Receive,
        send: Send,
        link: Link,
        *,
        connect: Callable[[str], Awaitable[Link]],
        release: Callable[[Link, str], None],
        request_id: str,
        routed: bool,
    ) -> None:
        """``connect(model)`` opens a link to a node serving ``model`` (raising ``ProxyError`` or ``Denied``);
        ``release(link, outcome)`` gives a node back; ``routed``: the model was in the query, nothing moves."""
        self._receive, self._send = receive, send
        self._connect, self._release, self._request_id = connect, release, request_id
        self._link = link
        self._routed = routed
        self._links = [link]
        self._tasks: list[asyncio.Task[None]] = []
        self._ended: asyncio.Future[tuple[str, int, str]] = asyncio.get_running_loop().create_future()

    def _end(self, outcome: str, code: int, reason: str) -> None:
        if not self._ended.done():
            self._ended.set_result((outcome, code, reason))

    async def run(self, accept: Message) -> str:
        """Accept the client, relay until one side closes, close the other with the same code; the outcome."""
        try:
            await self._send(accept)
            self._tasks.append(asyncio.create_task(self._from_client()))
            self._tasks.append(asyncio.create_task(self._from_node(self._link)))
            outcome, code, reason = await self._ended
            if outcome == "client_closed":
                await self._link.ws.close(_sendable(code, 1001), reason)
            else:
                with contextlib.suppress(OSError):
                    await self._send({"type": "websocket.close", "code": code, "reason": reason})
            return outcome
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for link in self._links:
                await _close(link)
                clean = link.ws.protocol.close_rcvd is not None
                self._release(link, "ok" if clean else "broken")

    async def _from_client(self) -> None:
        first = not self._routed
        while True:
            message: Message = await self._receive()
            if message["type"] == "websocket.disconnect":
                self._end("client_closed", message.get("code", 1005), message.get("reason") or "")
                return
            text: str | None = message.get("text")
            data: str | bytes = text if text is not None else message.get("bytes") or b""
            if first:
                first = False
                model = _event_model(text) if text is not None else None
                if model is not None and model not in self._link.state.models and not await self._move(model):
                    return
            try:
                await self._link.ws.send(data)
            except ConnectionClosed:
                return  # the node's pump reports how it ended

    async def _move(self, model: str) -> bool:
        """Carry the session to a node serving ``model``; False (and the client closed) when none takes it."""
        try:
            link = await self._connect(model)
        except (ProxyError, Denied) as exc:
            denied = Denied.of(exc, self._request_id)
            self._end(denied.outcome, denied.code, reason_text(denied.message))
            return False
        old, self._link = self._link, link
        old.retired, link.skip_created = True, True
        self._links.append(link)
        self._tasks.append(asyncio.create_task(self._from_node(link)))
        await old.ws.close()
        return True

    async def _from_node(self, link: Link) -> None:
        try:
            async for message in link.ws:
                if link.skip_created:
                    link.skip_created = False
                    if _is_session_created(message):
                        continue
                event: dict[str, Any] = {"type": "websocket.send"}
                event["text" if isinstance(message, str) else "bytes"] = message
                try:
                    await self._send(event)
                except OSError:  # uvicorn's ClientDisconnected: the client pump sees the disconnect
                    return
        except ConnectionClosed:
            pass
        if link.retired:
            return
        rcvd = link.ws.protocol.close_rcvd
        if rcvd is None:
            self._end("node_lost", 1011, f"node {link.state.node.node_id} went away")
        else:
            self._end("node_closed", _sendable(rcvd.code, 1000), rcvd.reason)


async def _close(link: Link) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.shield(link.ws.close()), CLOSE_TIMEOUT)
