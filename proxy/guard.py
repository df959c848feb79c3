"""Who may use the OpenAI routes, and how many requests a replica takes on at once.

Client keys are optional: with none configured the API is open (the embedded default, like vLLM without
--api-key). Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.errors import ProxyError, ServiceUnavailable, Unauthorized


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class ClientKeys:
    """The set of valid client API keys; empty means no key is needed."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(k.encode() for k in dict.fromkeys(keys) if k)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, request: Request) -> None:
        """401 unless the request carries ``Authorization: Bearer <one of the keys>``."""
        if not self._keys:
            return
        token = bearer_token(request)
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


class HeadersTooLarge(ProxyError):
    status = 431
    type = "invalid_request_error"
    code = "headers_too_large"


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
                error = HeadersTooLarge(f"request headers are larger than {self.max_bytes} bytes")
                body = json.dumps(error.body()).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                           (b"connection", b"close")]  # fmt: skip
                await send({"type": "http.response.start", "status": error.status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
