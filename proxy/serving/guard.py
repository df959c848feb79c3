"""Who may use the OpenAI routes, how many requests (and WebSocket sessions) a replica takes on at once, and how
large headers may be.

Client keys are optional: with none configured the API is open (the embedded default, like vLLM without
--api-key). The key set, its tenants and their limits live in ``tenancy/keys.py``; keys are never logged.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_etcd_proxy.proxy.errors import HeadersTooLarge, ServiceUnavailable, render
from vllm_etcd_proxy.proxy.tenancy.bearer import bearer_token
from vllm_etcd_proxy.proxy.tenancy.keys import KeySet as ClientKeys

__all__ = ["ClientKeys", "ConcurrencyLimit", "HeaderLimit", "bearer_token"]


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
