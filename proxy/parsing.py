"""Reading client requests: body size and time limits, JSON, and the few fields the proxy relies on.

Only what routing and the disaggregated exchange need is checked; every other field passes through to the
node untouched. A request that fails here never reaches any node.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from proxy.errors import BadRequest, PayloadTooLarge, ProxyError

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
MAX_MODEL_NAME = 512


class RequestTimeout(ProxyError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


@dataclass(frozen=True, kw_only=True)
class BodyLimits:
    max_bytes: int
    """Largest body accepted."""
    timeout: float
    """Seconds the client may take to send the whole body (slow clients cannot hold a slot forever)."""


def request_id_of(request: Request) -> str:
    """The client's X-Request-Id when it is sane, else a new one."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else uuid.uuid4().hex


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    """The raw body: 413 past ``max_bytes`` (checked against Content-Length first), 408 past ``timeout``."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limits.max_bytes:
        raise PayloadTooLarge(f"request body is larger than {limits.max_bytes} bytes")
    raw = bytearray()
    try:
        async with asyncio.timeout(limits.timeout):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > limits.max_bytes:
                    raise PayloadTooLarge(f"request body is larger than {limits.max_bytes} bytes")
    except TimeoutError:
        raise RequestTimeout(f"request body was not received within {limits.timeout:g} s") from None
    except ClientDisconnect:
        raise BadRequest("client disconnected while sending the body") from None
    return bytes(raw)


AFFINITY_PREFIX_CHARS = 2048
"""How much of the prompt names a conversation for consistent-hash: enough for a system prompt and the
first turn, which is what a node's prefix cache can reuse."""


def affinity_key(body: dict[str, Any], header_value: str | None) -> str | None:
    """What consistent-hash routes by: the session header, else the body's ``user``, else the prompt's start."""
    if header_value:
        return f"session:{header_value}"
    user = body.get("user")
    if isinstance(user, str) and user:
        return f"user:{user}"
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        return "prefix:" + json.dumps(messages[:2], sort_keys=True, default=str)[:AFFINITY_PREFIX_CHARS]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return "prefix:" + prompt[:AFFINITY_PREFIX_CHARS]
    return None


def parse_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _int_field(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise BadRequest(f"'{name}' must be a non-negative integer", param=name)


def check_fields(body: dict[str, Any], route: str) -> str:
    """Validate the fields the proxy reads or rewrites; return the model name."""
    model = body.get("model")
    if not isinstance(model, str) or not model or len(model) > MAX_MODEL_NAME:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    for name in ("max_tokens", "max_completion_tokens", "min_tokens", "n"):
        _int_field(body, name)
    if route == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a non-empty array of message objects", param="messages")
    elif route == "/v1/completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list) or (isinstance(prompt, list) and not prompt):
            raise BadRequest("'prompt' must be a string or a non-empty array", param="prompt")
    return model
