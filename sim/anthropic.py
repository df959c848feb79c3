"""vLLM's Anthropic Messages API, ``POST /v1/messages`` (vllm/entrypoints/anthropic/), served by the chat machinery.

- Non-streamed: ``{"id": "chatcmpl-...", "type": "message", "role": "assistant", "content": [{"type": "text",
  "text"}], "model", "stop_reason": "end_turn" | "max_tokens", "usage": {"input_tokens", "output_tokens"}}``.
- Streamed: ``event: <type>\\ndata: <json>\\n\\n`` for message_start, content_block_start, content_block_delta
  (``text_delta``, one per token), content_block_stop, message_delta (``stop_reason``, usage), message_stop, then
  ``data: [DONE]`` as vLLM ends it.
- Errors of the handler (an unknown model) use Anthropic's envelope ``{"type": "error", "error": {"type",
  "message"}}``; a body that fails validation gets vLLM's usual OpenAI-shaped 400, as vLLM's global handler does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vllm_etcd_proxy.sim import protocol, tokens
from vllm_etcd_proxy.sim.engine import Engine
from vllm_etcd_proxy.sim.errors import ApiError, bad_request
from vllm_etcd_proxy.sim.record import Job
from vllm_etcd_proxy.sim.recording import engine_of, json_body, new_record
from vllm_etcd_proxy.sim.sse import SSEResponse, answer_whole
from vllm_etcd_proxy.sim.wire import DONE_EVENT

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
"""vLLM's map; an aborted answer has no stop_reason (null)."""


def anthropic_error(exc: ApiError) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": exc.type, "message": exc.message}}, status_code=exc.status)


def _messages(body: dict[str, Any]) -> list[tuple[str, str]]:
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(b.get("text", "") for b in system if isinstance(b, dict) and b.get("type") == "text")
    out = [("system", system)] if isinstance(system, str) and system else []
    return out + protocol.messages(body.get("messages"))


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n"


async def messages(request: Request) -> Response:
    engine, record = engine_of(request), new_record(request)
    try:
        body = await json_body(request, record)
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.")
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise bad_request("Field required: `max_tokens` (a positive integer).", "max_tokens")
        prompt = tokens.render_chat(
            _messages(body), add_generation_prompt=True, continue_final_message=False, encoder=engine.encode
        )
        model = body.get("model")
        record.model, record.stream = (model if isinstance(model, str) else None), bool(body.get("stream"))
        record.prompt_tokens, record.max_tokens = len(prompt), max_tokens
    except ApiError as exc:
        engine.reject(record, exc.status)
        raise
    try:
        protocol.check_model(model, engine.served_names)
        if engine.should_fail():
            raise ApiError(engine.knobs.fail_status, "vllm-sim: injected failure")
    except ApiError as exc:
        engine.reject(record, exc.status)
        return anthropic_error(exc)
    record.id = f"chatcmpl-{record.request_id or uuid.uuid4().hex}"
    answer = tokens.complete(prompt, max_tokens=max_tokens, output_len=engine.knobs.output_len)
    job = Job(
        record=record, prompt=tuple(prompt), tokens=answer.tokens, finish_reason=answer.finish_reason, kv_loaded=False
    )
    name = engine.model_name(record.model)
    if record.stream:
        return SSEResponse(lambda start: _stream(engine, job, name, start), engine, record, {})

    async def collect() -> Response:
        async with aclosing(engine.generate(job)) as stream:
            out = [token async for token in stream]
        return JSONResponse(
            {
                "id": record.id,
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": tokens.decode(out)}] if out else [],
                "model": name,
                "stop_reason": STOP_REASONS.get(job.finished_as),
                "usage": {"input_tokens": len(prompt), "output_tokens": len(out)},
            }
        )

    return await answer_whole(engine, record, collect(), request.receive, on_error=anthropic_error)


async def _stream(engine: Engine, job: Job, model: str, start: Callable[[], Awaitable[None]]) -> AsyncGenerator[str]:
    record = job.record
    usage = {"input_tokens": record.prompt_tokens, "output_tokens": 0}
    message: dict[str, Any] = {
        "id": record.id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    try:
        async with aclosing(engine.generate(job, on_accept=start)) as stream:
            first = True
            async for token in stream:
                if first:
                    yield _event("message_start", message=message)
                    yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                    first = False
                yield _event(
                    "content_block_delta", index=0, delta={"type": "text_delta", "text": tokens.token_text(token)}
                )
        if first:
            yield _event("message_start", message=message)
        else:
            yield _event("content_block_stop", index=0)
        stop = STOP_REASONS.get(job.finished_as)
        yield _event(
            "message_delta",
            delta={"stop_reason": stop},
            usage={"input_tokens": record.prompt_tokens, "output_tokens": record.completion_tokens},
        )
        yield _event("message_stop")
    except ApiError as exc:
        yield _event("error", error={"type": exc.type, "message": exc.message})
    yield DONE_EVENT


ROUTES = [Route("/v1/messages", messages, methods=["POST"])]
