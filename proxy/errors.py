"""Errors the proxy answers with, each mapped to an HTTP status and an OpenAI-style body in one handler.

ProxyError                      -> its ``status``; body ``{"error": {"message", "type", "param", "code"}}``
├── BadRequest           400    malformed JSON, wrong field types
├── Unauthorized         401    missing or wrong key
├── Forbidden            403    admin API disabled or key wrong
│   └── NodeAdminRefused 403    a vLLM node-admin route (sleep, adapters, cache resets), never load-balanced
├── NotFound             404    unknown route
│   └── ModelNotFound    404    unknown model (the message lists the known ones)
├── MethodNotAllowed     405
├── RequestTimeout       408    the body took longer than --body-timeout
├── PayloadTooLarge      413
├── HeadersTooLarge      431
├── ClientLeft           499    the client went away while its request was queued (nothing is sent)
├── RateLimited          429    a key over its rpm, tpm or concurrency (``Retry-After``, ``x-ratelimit-*``)
├── ServiceUnavailable   503    a dependency (etcd) is unreachable (``Retry-After``)
│   ├── NoNodeAvailable  503    nothing routable now
│   ├── QueueTimeout     503    waited --queue-timeout for a full model's nodes
│   └── WakeTimeout      503    waited --wake-timeout for a sleeping model's node to wake
├── UpstreamFailed       502    every attempt failed before a byte reached the client
└── UpstreamTimeout      504    a configured timeout fired

Transport errors are raised as UpstreamFailed/UpstreamTimeout where they happen (transport.py); etcd errors
stay in fleet/etcd. ``render`` is the one place an error becomes an HTTP answer.
"""

from __future__ import annotations

from typing import Any

import orjson


class ProxyError(Exception):
    status = 500
    type = "internal_error"
    code = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None, close: bool = False
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.close = close
        """Answer with ``Connection: close`` (the request was not read to its end)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


ANTHROPIC_ROUTE = "/v1/messages"
"""vLLM serves Anthropic's Messages API here; the proxy's own errors on it use Anthropic's envelope."""
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_body(exc: ProxyError) -> dict[str, Any]:
    """``exc`` in Anthropic's error envelope, which Anthropic's SDKs read."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(exc.status, "api_error"), "message": exc.message}}


def render(
    exc: ProxyError, request_id: str | None = None, *, anthropic: bool = False
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers and JSON body of the answer for ``exc``: OpenAI's shape, or Anthropic's on its route."""
    body = orjson.dumps(anthropic_body(exc) if anthropic else exc.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode("latin-1", "replace")))
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
    if exc.close:
        headers.append((b"connection", b"close"))
    return exc.status, headers, body


def sse_error_event(exc: ProxyError, *, anthropic: bool = False) -> bytes:
    """How a stream that already started ends when it fails: the error as an event, then ``[DONE]`` (Anthropic's
    streams end with an ``error`` event instead)."""
    if anthropic:
        return b"event: error\ndata: " + orjson.dumps(anthropic_body(exc)) + b"\n\n"
    return b"data: " + orjson.dumps(exc.body()) + b"\n\ndata: [DONE]\n\n"


class BadRequest(ProxyError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(ProxyError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(ProxyError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NodeAdminRefused(Forbidden):
    code = "node_admin_route"


class NotFound(ProxyError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(ProxyError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class RequestTimeout(ProxyError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class HeadersTooLarge(ProxyError):
    status = 431
    type = "invalid_request_error"
    code = "headers_too_large"


class ClientLeft(ProxyError):
    status = 499
    code = "client_left"


class RateLimited(ProxyError):
    """OpenAI's answer over a limit: ``type`` says which kind ("requests", "tokens", "concurrency")."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, kind: str, headers: dict[str, str]):
        super().__init__(message, headers=headers)
        self.type = kind


class ServiceUnavailable(ProxyError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int = 1):
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class NoNodeAvailable(ServiceUnavailable):
    code = "no_available_node"


class QueueTimeout(ServiceUnavailable):
    code = "queue_timeout"


class WakeTimeout(ServiceUnavailable):
    code = "wake_timeout"


class UpstreamFailed(ProxyError):
    status = 502
    type = "upstream_error"
    code = "upstream_failed"


class UpstreamTimeout(ProxyError):
    status = 504
    type = "upstream_error"
    code = "upstream_timeout"
