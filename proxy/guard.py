"""Who may use the OpenAI routes, and how many requests a replica takes on at once.

Client keys are optional: with none configured the API is open (the embedded default, like vLLM without
--api-key). Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.requests import Request

from proxy.errors import ServiceUnavailable, Unauthorized


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
