"""Reading client requests straight from ASGI: headers, the body within its limits, and the few JSON fields the
proxy relies on.

Only what routing and the disaggregated exchange need is checked; every other field passes through to the
node untouched. A request that fails here never reaches any node.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
from starlette.types import Receive, Scope

from vllm_etcd_proxy.proxy.errors import BadRequest, PayloadTooLarge, RequestTimeout
from vllm_etcd_proxy.proxy.serving.forwarder import NOT_FORWARDED

_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")
MAX_MODEL_NAME = 512
DISCARD_BYTES = 256 * 1024 * 1024
"""How much of a body over the limit is read (and dropped) before the 413, so the client is still reading
when the answer comes instead of getting a connection reset."""


@dataclass(frozen=True, kw_only=True)
class BodyLimits:
    max_bytes: int
    """Largest body accepted."""
    timeout: float
    """Seconds the client may take to send the whole body (slow clients cannot hold a slot forever)."""


class ClientRequest(NamedTuple):
    """What the proxy takes from a request's headers, in one pass over them."""

    forwarded: list[tuple[bytes, bytes]]
    """Headers for the nodes: the client's minus hop-by-hop ones, with the request id (and backend key)."""
    request_id: str
    authorization: bytes | None
    content_length: int | None
    session: str | None
    """The affinity header's value, if the client sent one."""
    content_type: bytes | None


def read_headers(scope: Scope, *, session_header: bytes, backend_auth: bytes | None) -> ClientRequest:
    """The client's headers sorted into what is forwarded and what the proxy reads itself."""
    forwarded: list[tuple[bytes, bytes]] = []
    request_id = authorization = length = session = content_type = None
    for name, value in scope["headers"]:
        if name == b"content-type":
            content_type = value
            forwarded.append((name, value))
        elif name == b"x-request-id":
            request_id = value
        elif name == b"content-length":
            length = value
        elif name == b"authorization":
            authorization = value
            if backend_auth is None:
                forwarded.append((name, value))
        elif name in NOT_FORWARDED:
            continue
        else:
            if name == session_header:
                session = value
            forwarded.append((name, value))
    valid = request_id is not None and _REQUEST_ID.match(request_id)
    rid = request_id.decode("ascii") if request_id is not None and valid else os.urandom(16).hex()
    forwarded.append((b"x-request-id", rid.encode("ascii")))
    if backend_auth is not None:
        forwarded.append((b"authorization", backend_auth))
    return ClientRequest(
        forwarded=forwarded,
        request_id=rid,
        authorization=authorization,
        content_length=int(length) if length is not None and length.isdigit() else None,
        session=session.decode("latin-1") if session else None,
        content_type=content_type,
    )


async def read_body(receive: Receive, declared: int | None, limits: BodyLimits) -> bytes:
    """The raw body: 413 past ``max_bytes``, 408 past ``timeout``, 400 when the client leaves half-way.

    A body over the limit is still read on (and dropped), up to ``DISCARD_BYTES`` or the timeout: a client
    that is still sending when the server closes gets a connection reset instead of the 413.
    """
    message = await receive()
    body: bytes = message.get("body", b"")
    too_large = (declared is not None and declared > limits.max_bytes) or len(body) > limits.max_bytes
    if not message.get("more_body", False) and not too_large:
        if message["type"] == "http.disconnect":
            raise BadRequest("client disconnected while sending the body")
        return body
    parts = [] if too_large else [body]
    size = len(body)
    try:
        async with asyncio.timeout(limits.timeout):
            while message.get("more_body", False) and size <= DISCARD_BYTES:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise BadRequest("client disconnected while sending the body")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limits.max_bytes:
                    too_large, parts = True, []
                elif not too_large:
                    parts.append(chunk)
    except TimeoutError:
        if not too_large:
            raise RequestTimeout(f"request body was not received within {limits.timeout:g} s") from None
    if too_large:
        raise PayloadTooLarge(f"request body is larger than {limits.max_bytes} bytes", close=True)
    return b"".join(parts)


def parse_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        # orjson refuses a few things Python's json takes (integers past 64 bits, NaN); so do vLLM's servers
        # sometimes, but that is for the node to say.
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


_INT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "n")


def model_field(body: dict[str, Any]) -> str | None:
    """The body's ``model``: None when absent (vLLM then serves its first model), 400 when not a name."""
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str) or not model or len(model) > MAX_MODEL_NAME:
        raise BadRequest("'model' must be a non-empty string", param="model")
    return model


def check_fields(body: dict[str, Any], route: str) -> str | None:
    """Validate the fields the proxy reads or rewrites; return the model name (None when the body names none)."""
    model = model_field(body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    for name in _INT_FIELDS:
        if name in body:
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
