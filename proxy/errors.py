"""Errors the proxy answers with, each mapped to an HTTP status and an OpenAI-style body in one handler.

ProxyError                      -> its ``status``; body ``{"error": {"message", "type", "param", "code"}}``
├── BadRequest           400    malformed JSON, wrong field types
├── Unauthorized         401    missing or wrong key
├── Forbidden            403    admin API disabled or key wrong
├── NotFound             404    unknown route
│   └── ModelNotFound    404    unknown model (the message lists the known ones)
├── MethodNotAllowed     405
├── PayloadTooLarge      413
├── ServiceUnavailable   503    a dependency (etcd) is unreachable (``Retry-After``)
│   └── NoNodeAvailable  503    nothing routable now
├── UpstreamFailed       502    every attempt failed before a byte reached the client
└── UpstreamTimeout      504    a configured timeout fired

httpx errors are translated into UpstreamFailed/UpstreamTimeout in forwarder.py; etcd errors stay in etcd.py.
"""

from __future__ import annotations

from typing import Any


class ProxyError(Exception):
    status = 500
    type = "internal_error"
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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


class PayloadTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class ServiceUnavailable(ProxyError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int = 1):
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class NoNodeAvailable(ServiceUnavailable):
    code = "no_available_node"


class UpstreamFailed(ProxyError):
    status = 502
    type = "upstream_error"
    code = "upstream_failed"


class UpstreamTimeout(ProxyError):
    status = 504
    type = "upstream_error"
    code = "upstream_timeout"
