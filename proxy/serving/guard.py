"""Who may use the OpenAI routes, how many requests a replica takes on at once, and how large headers may be;
``SessionGuard`` applies the first two (and the tenant's concurrency) to a WebSocket session.

Client keys are optional: with none configured the API is open (the embedded default, like vLLM without
--api-key). The key set, its tenants and their limits live in ``tenancy/keys.py``; keys are never logged.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_etcd_proxy.proxy.errors import HeadersTooLarge, ServiceUnavailable, render
from vllm_etcd_proxy.proxy.tenancy.admission import Tenancy, Ticket
from vllm_etcd_proxy.proxy.tenancy.bearer import bearer_token
from vllm_etcd_proxy.proxy.tenancy.keys import KeySet as ClientKeys

__all__ = ["ClientKeys", "ConcurrencyLimit", "HeaderLimit", "SessionGuard", "SessionHold", "bearer_token"]


class ConcurrencyLimit:
    """At most ``limit`` proxied requests in flight on this replica; the next gets 503 with Retry-After."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def acquire(self) -> None:
        if self.limit and self.in_flight >= self.limit:
            raise ServiceUnavailable(
                f"this replica is at its limit of {self.limit} concurrent requests; retry shortly", retry_after=1
            )
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


class SessionHold:
    """What an open WebSocket session holds: a slot of the replica's limit, maybe one of its tenant's; ``close``
    gives them back (once)."""

    __slots__ = ("_limit", "_ticket", "_closed")

    def __init__(self, limit: ConcurrencyLimit, ticket: Ticket | None) -> None:
        self._limit, self._ticket, self._closed = limit, ticket, False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._limit.release()
        if self._ticket is not None:
            self._ticket.finish(101)  # a session's tokens are not counted: only its slot is given back


class SessionGuard:
    """A WebSocket session, before a node is picked: a valid client key (401), a slot of its tenant's concurrency
    limit (429, tenancy/), a slot of ``--max-concurrent-requests`` (503), held until the session ends."""

    def __init__(self, keys: ClientKeys, limit: ConcurrencyLimit, tenancy: Tenancy | None) -> None:
        self._keys, self._limit, self._tenancy = keys, limit, tenancy

    async def open(self, authorization: str | bytes | None) -> SessionHold:
        """Raises ``Unauthorized``, ``RateLimited`` or ``ServiceUnavailable``."""
        limits = self._keys.check(authorization)
        ticket = await self._tenancy.admit_session(limits) if self._tenancy is not None else None
        try:
            self._limit.acquire()
        except ServiceUnavailable:
            if ticket is not None:
                ticket.finish(503)
            raise
        return SessionHold(self._limit, ticket)


class HeaderLimit:
    """ASGI middleware: 431 for requests whose headers add up to more than ``max_bytes``.

    The HTTP parser has already read them, but nothing of ours (nor any node) ever handles them.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.max_bytes:
            size = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > self.max_bytes:
                error = HeadersTooLarge(f"request headers are larger than {self.max_bytes} bytes", close=True)
                status, headers, body = render(error)
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
