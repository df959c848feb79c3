"""What one request is to the engine: its ``Record`` (what the node saw, served by GET /sim/requests) and, for a
generation, its ``Job`` (the prompt and the answer already decided)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(kw_only=True)
class Record:
    """One request as the node saw it; served as JSON by GET /sim/requests. Never holds the prompt."""

    id: str
    """The response id (cmpl-/chatcmpl-...), empty for requests refused before parsing."""
    request_id: str | None
    """The X-Request-Id header as received."""
    path: str
    authorization: str | None
    """The Authorization header as received (tests check what the proxy forwarded)."""
    cookie: str | None = None
    """The Cookie header as received (tests check that one client's cookies never reach another's request)."""
    body_sha256: str | None = None
    """SHA-256 of the request body as received (tests check what the proxy forwarded, byte for byte)."""
    received_at: float = field(default_factory=time.time)
    model: str | None = None
    stream: bool = False
    state: str = "received"
    """received -> [hung ->] [sleeping ->] waiting -> running [-> hung (hang_after_tokens) ...] -> done | cancelled
    | failed | aborted (by a sleep); or rejected (an error answer); a WebSocket session is open -> closed."""
    status: int | None = None
    cancelled: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when the request was scheduled."""
    completion_tokens: int = 0
    max_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """kv_transfer_params exactly as received."""
    prefill: dict[str, Any] | None = None
    """On a decode leg: the remote_engine_id, remote_host and remote_port the KV was pulled from."""
    method: str = "POST"
    """The HTTP method, or ``WEBSOCKET`` for a WebSocket session."""
    query: str = ""
    """The query string as received (without the ``?``)."""
    content_type: str | None = None
    body_length: int | None = None
    """Bytes of the request body as received (with body_sha256: what the proxy forwarded, byte for byte)."""
    body_request_id: str | None = None
    """The body's ``request_id`` field (vLLM names a Responses API response by it)."""
    session_id: str | None = None
    """The body's ``session_id`` field."""
    cache_salt: str | None = None
    """The body's ``cache_salt`` field."""
    priority: int | None = None
    """The body's ``priority`` field."""
    data_parallel_rank: str | None = None
    """The ``X-data-parallel-rank`` header as received."""
    traceparent: str | None = None
    """The ``traceparent`` header as received."""
    upload_sha256: str | None = None
    """SHA-256 of the uploaded ``file`` of a multipart audio request, as the node parsed it."""
    upload_size: int | None = None
    upload_filename: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    """Route-specific facts: form fields of an audio request, events and close of a WebSocket session, ..."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Job:
    """A validated generation: its prompt, the tokens it will produce, how the first is timed, how it finishes."""

    record: Record
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    finish_reason: str
    kv_loaded: bool
    """Decode leg with usable remote KV: the first token comes after one itl instead of ttft."""
    cache_salt: str | None = None
    """vLLM's cache_salt: salts the prefix cache's block hashes."""
    adapter: str | None = None
    """The LoRA adapter the request names (its ``model``), None for a base model."""

    @property
    def finished_as(self) -> str:
        """The finish reason the answer ends with: "abort" when an aborting sleep cut it short."""
        return "abort" if self.record.state == "aborted" else self.finish_reason
