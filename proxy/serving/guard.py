"""Who may use the OpenAI routes, how many requests a replica takes on at once, and how large headers may be.

Client keys are optional: with none configured the API is open (the embedded default, like vLLM without
--api-key). Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_etcd_proxy.proxy.errors import HeadersTooLarge, ServiceUnavailable, Unauthorized, render


def bearer_token(authorization: str | bytes | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None."""
    if not authorization:
        return None
    text = authorization.decode("latin-1") if isinstance(authorization, bytes) else authorization
    scheme, _, token = text.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class ClientKeys:
    """The set of valid client API keys; empty means no key is needed."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(k.encode() for k in dict.fromkeys(keys) if k)

    def check(self, authorization: str | bytes | None) -> None:
        """401 unless ``authorization`` is ``Bearer <one of the keys>``."""
        if not self._keys:
            return
        token = bearer_token(authorization)
        if token is None:
            raise Unauthorized("an API key is required: send it as 'Authorization: Bearer <key>'")
        given = token.encode()
        # Compare against every key so timing does not tell which one (or whether any) nearly matched.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise Unauthorized("the API key is not valid")


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
