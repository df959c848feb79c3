"""The token of an ``Authorization: Bearer`` header (the key set and the WebSocket routes read it alike)."""

from __future__ import annotations


def bearer_token(authorization: str | bytes | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None."""
    if not authorization:
        return None
    text = authorization.decode("latin-1") if isinstance(authorization, bytes) else authorization
    scheme, _, token = text.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None
