"""What the node remembers of each request (GET /sim/requests), and reading a request body into that record.

Tests of the proxy read these records to prove what reached a node: the path, query and method, the body's bytes
(SHA-256 and length), the headers that must pass unchanged (X-Request-Id, X-data-parallel-rank, traceparent) and
the body fields vLLM routes or caches by (request_id, session_id, cache_salt, priority).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from starlette.requests import HTTPConnection, Request

from vllm_etcd_proxy.sim.engine import Engine
from vllm_etcd_proxy.sim.errors import bad_request
from vllm_etcd_proxy.sim.record import Record


def engine_of(connection: HTTPConnection) -> Engine:
    engine: Engine = connection.app.state.engine
    return engine


def media_type(connection: HTTPConnection) -> str:
    return connection.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def new_record(connection: HTTPConnection, *, method: str | None = None) -> Record:
    """A record of ``connection`` with its headers, counted as received by the engine."""
    headers = connection.headers
    record = Record(
        id="",
        request_id=headers.get("x-request-id"),
        path=connection.url.path,
        authorization=headers.get("authorization"),
        cookie=headers.get("cookie"),
        method=method or connection.scope.get("method", "GET"),
        query=connection.url.query,
        content_type=headers.get("content-type"),
        data_parallel_rank=headers.get("x-data-parallel-rank"),
        traceparent=headers.get("traceparent"),
    )
    engine_of(connection).receive(record)
    return record


async def raw_body(request: Request, record: Record) -> bytes:
    """The body as received; its SHA-256 and length go into the record."""
    raw = await request.body()
    record.body_sha256 = hashlib.sha256(raw).hexdigest()
    record.body_length = len(raw)
    return raw


def note_fields(record: Record, body: Any) -> None:
    """The body fields a router cares about, where present and of the right type."""
    if not isinstance(body, dict):
        return
    for name in ("request_id", "session_id", "cache_salt"):
        value = body.get(name)
        if isinstance(value, str):
            setattr(record, "body_request_id" if name == "request_id" else name, value)
    priority = body.get("priority")
    if isinstance(priority, int) and not isinstance(priority, bool):
        record.priority = priority


async def json_body(request: Request, record: Record) -> Any:
    """A JSON body, refused as vLLM's validate_json_request refuses another media type."""
    if media_type(request) != "application/json":
        await raw_body(request, record)
        raise bad_request("Unsupported Media Type: Only 'application/json' is allowed")
    raw = await raw_body(request, record)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"JSON decode error: {exc}") from None
    note_fields(record, body)
    return body
