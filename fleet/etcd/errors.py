"""etcd's errors as ours, and the gRPC ones translated at the boundary::

EtcdError              etcd refused or failed a request (``.code`` is the gRPC status name, if any)
+-- EtcdUnavailable    no endpoint answered in time, a stream broke or went silent: retry, resume
+-- Compacted          a watch's start revision was compacted away: re-list
+-- LeaseLost          a lease expired, was revoked, or could not be refreshed within its TTL
+-- EtcdAuthError      bad user or password, or permission denied
"""

from __future__ import annotations

import grpc  # type: ignore[import-untyped,unused-ignore]
import grpc.aio  # type: ignore[import-untyped,unused-ignore]

_TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class EtcdError(Exception):
    """etcd refused or failed a request."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """No endpoint answered in time, or a stream broke."""


class Compacted(EtcdError):
    """The watch start revision is older than etcd's compaction point."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted; oldest available is {compact_revision}", "OUT_OF_RANGE")
        self.compact_revision = compact_revision


class LeaseLost(EtcdError):
    """The lease is gone (expired or revoked) or could not be refreshed for longer than its TTL."""


class EtcdAuthError(EtcdError):
    """Authentication failed or the user lacks permission."""


def transient(exc: grpc.aio.AioRpcError) -> bool:
    """Worth a retry on another member: unreachable, too slow, or gRPC's own transport hiccup (seen as INTERNAL
    "Internal error from Core" on a stream whose member just died; etcd's own errors carry etcd's words)."""
    code = exc.code()
    return code in _TRANSIENT or (code == grpc.StatusCode.INTERNAL and "from Core" in (exc.details() or ""))


def member_answered(exc: grpc.aio.AioRpcError) -> bool:
    """The member is up but said it cannot serve right now ("etcdserver: no leader", "leader changed", "request
    timed out"): an election is on, or this member is cut off from the others."""
    return (exc.details() or "").startswith("etcdserver:")


def bad_token(exc: grpc.aio.AioRpcError) -> bool:
    return "invalid auth token" in (exc.details() or "")


def translate(exc: grpc.aio.AioRpcError, endpoint: str) -> EtcdError:
    code = exc.code()
    message = f"etcd {endpoint}: {code.name} {exc.details() or ''}".strip()
    if transient(exc) or code == grpc.StatusCode.CANCELLED:
        return EtcdUnavailable(message, code.name)
    details = exc.details() or ""
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or any(
        text in details for text in ("authentication", "user name", "password")
    ):
        return EtcdAuthError(message, code.name)
    return EtcdError(message, code.name)
