"""vLLM's speech-to-text routes (vllm/entrypoints/openai/speech_to_text/): POST /v1/audio/transcriptions and
/v1/audio/translations, a ``multipart/form-data`` body with the audio as ``file`` and the other fields as form
fields (``model``, ``language``, ``prompt``, ``response_format``, ``stream``, ``stream_include_usage``, ...).

The simulated model "hears" the upload's SHA-256: the transcript is the answer to a prompt made of it, so the same
bytes always give the same text, and the record keeps the upload's SHA-256, size and file name to prove the bytes
arrived intact. The audio counts as 16 kHz 16-bit mono for its duration.

- ``response_format`` ``json`` (default): transcriptions ``{"text", "usage": {"type": "duration", "seconds"}}``,
  translations ``{"text"}``; ``text``: the text as text/plain; others are vLLM's 400s.
- ``stream=true``: SSE ``data: {"id": "transcribe-<id>", "object": "transcription.chunk", "created", "model",
  "choices": [{"delta": {"content"}}]}`` per token (the last choice adds ``finish_reason`` and ``stop_reason``),
  an optional usage chunk, then ``data: [DONE]`` (``translate-``/``translation.chunk`` for translations).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from vllm_etcd_proxy.sim import protocol, tokens
from vllm_etcd_proxy.sim.engine import Engine
from vllm_etcd_proxy.sim.errors import ApiError, bad_request
from vllm_etcd_proxy.sim.record import Job, Record
from vllm_etcd_proxy.sim.recording import engine_of, media_type, new_record, raw_body
from vllm_etcd_proxy.sim.sse import SSEResponse, answer_whole
from vllm_etcd_proxy.sim.wire import DONE_EVENT

BYTES_PER_SECOND = 16000 * 2
_TRUE = {"true", "1", "yes", "on"}


def _flag(form: dict[str, str], name: str) -> bool:
    return form.get(name, "false").strip().lower() in _TRUE


async def _read(request: Request, record: Record) -> tuple[dict[str, str], bytes]:
    """The form's text fields and the uploaded file's bytes."""
    await raw_body(request, record)
    if media_type(request) != "multipart/form-data":
        raise bad_request("Field required: `file` (the body must be multipart/form-data).", "file")
    async with request.form() as form:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise bad_request("Expected 'file' to be a file-like object, not 'str'.", "file")
        data = await upload.read()
        record.upload_filename = upload.filename
        fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
        record.detail = {"form": fields, "upload_content_type": upload.content_type}
    record.upload_sha256, record.upload_size = hashlib.sha256(data).hexdigest(), len(data)
    return fields, data


def _chunk(rid: str, obj: str, created: int, model: str | None, choices: list[Any], **extra: Any) -> str:
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _speech_to_text(request: Request, task: str) -> Response:
    engine, record = engine_of(request), new_record(request)
    try:
        form, data = await _read(request, record)
        model = form.get("model")
        record.model, record.stream = model, _flag(form, "stream")
        protocol.check_model(model, engine.served_names)
        fmt = form.get("response_format", "json")
        if fmt not in ("json", "text", "verbose_json"):
            raise ApiError(400, "Currently only support response_format`text`, `json` or `verbose_json`")
        if fmt == "verbose_json":
            raise ApiError(400, f"Currently do not support verbose_json for {model}")
        if not record.stream and (_flag(form, "stream_include_usage") or _flag(form, "stream_continuous_usage_stats")):
            raise bad_request("Stream options can only be defined when `stream=True`.", "stream_include_usage")
        if not data:
            raise bad_request("Invalid or empty audio file.", "file")
        limit = form.get("max_completion_tokens")
        max_tokens = int(limit) if limit and limit.isdigit() and int(limit) > 0 else None
        if engine.should_fail():
            raise ApiError(engine.knobs.fail_status, "vllm-sim: injected failure")
    except ApiError as exc:
        engine.reject(record, exc.status)
        raise
    prompt = tokens.encode(f"{task} {record.upload_sha256} {form.get('language', '')} {form.get('prompt', '')}")
    answer = tokens.complete(prompt, max_tokens=max_tokens, output_len=engine.knobs.output_len)
    record.prompt_tokens, record.max_tokens = len(prompt), max_tokens
    rid = f"{task}-{record.request_id or uuid.uuid4().hex}"
    record.id = rid
    job = Job(
        record=record, prompt=tuple(prompt), tokens=answer.tokens, finish_reason=answer.finish_reason, kv_loaded=False
    )
    if record.stream:
        obj = "transcription.chunk" if task == "transcribe" else "translation.chunk"
        return SSEResponse(lambda start: _stream(engine, job, form, rid, obj, start), engine, record, {})
    seconds = math.ceil(len(data) / BYTES_PER_SECOND)

    async def collect() -> Response:
        async with aclosing(engine.generate(job)) as stream:
            text = tokens.decode([token async for token in stream])
        if fmt == "text":
            return PlainTextResponse(text)
        usage = {"usage": {"type": "duration", "seconds": seconds}} if task == "transcribe" else {}
        return JSONResponse({"text": text, **usage})

    return await answer_whole(engine, record, collect(), request.receive)


async def _stream(
    engine: Engine, job: Job, form: dict[str, str], rid: str, obj: str, start: Callable[[], Awaitable[None]]
) -> AsyncGenerator[str, None]:
    created, model, record = int(time.time()), form.get("model"), job.record
    include_usage = _flag(form, "stream_include_usage")
    continuous = include_usage and _flag(form, "stream_continuous_usage_stats")
    last = len(job.tokens) - 1

    def use() -> dict[str, int]:
        done = record.completion_tokens
        return {
            "prompt_tokens": record.prompt_tokens,
            "total_tokens": record.prompt_tokens + done,
            "completion_tokens": done,
        }

    try:
        async with aclosing(engine.generate(job, on_accept=start)) as stream:
            i = 0
            async for token in stream:
                choice: dict[str, Any] = {"delta": {"content": tokens.token_text(token)}}
                if i == last:
                    choice.update(finish_reason=job.finish_reason, stop_reason=None)
                i += 1
                yield _chunk(rid, obj, created, model, [choice], **({"usage": use()} if continuous else {}))
        if job.finished_as == "abort":
            choice = {"delta": {"content": ""}, "finish_reason": "abort", "stop_reason": None}
            yield _chunk(rid, obj, created, model, [choice], **({"usage": use()} if continuous else {}))
        if include_usage:
            yield _chunk(rid, obj, created, model, [], usage=use())
    except ApiError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    yield DONE_EVENT


async def transcriptions(request: Request) -> Response:
    return await _speech_to_text(request, "transcribe")


async def translations(request: Request) -> Response:
    return await _speech_to_text(request, "translate")


ROUTES = [
    Route("/v1/audio/transcriptions", transcriptions, methods=["POST"]),
    Route("/v1/audio/translations", translations, methods=["POST"]),
]
