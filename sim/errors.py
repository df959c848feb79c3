"""Errors the simulated node answers with, in vLLM's shape, mapped to HTTP in one handler (app.py).

ApiError            -> ``status``; body ``{"error": {"message", "type", "param", "code"}}`` (vLLM >= 0.10)
├── 400 BadRequestError    invalid body, or "Bad Request" for what vLLM's pydantic validation rejects
├── 404 NotFoundError      unknown model (param "model")
└── injected               --fail-rate: 500 InternalServerError, 503/429 as configured

vLLM's --api-key refusal is not an ApiError: its middleware answers 401 ``{"error": "Unauthorized"}``.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    """The ``type`` vLLM's create_error_response uses for a status (its default is BadRequestError)."""
    if status in _TYPES:
        return _TYPES[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "InternalServerError"


class ApiError(Exception):
    """An answer other than 200, as vLLM would give it."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type(status)
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    """What vLLM answers when its request model's validation fails (FastAPI RequestValidationError)."""
    return ApiError(400, message, type=HTTPStatus.BAD_REQUEST.phrase, param=param)
