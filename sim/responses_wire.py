"""vLLM's Responses API shapes (vllm/entrypoints/openai/responses/protocol.py and serving.py), without any I/O.

- The response id is the request body's ``request_id``, as sent (``ResponsesResponse.from_request`` sets ``id =
  request.request_id``); without one it is ``resp_<32 hex>`` (vLLM's ``f"resp_{random_uuid()}"``). The X-Request-Id
  header does not change it.
- The prompt is the chat template over: the request's ``instructions`` as a system message, the previous
  response's input messages (its system messages dropped), its output text as an assistant message, then this
  request's ``input`` (a string is one user message) -- so a conversation chained by ``previous_response_id`` is
  one growing prefix.
- Streamed events are ``event: <type>\\ndata: <json>\\n\\n`` with a ``sequence_number`` from 0, no ``[DONE]``:
  response.created, response.in_progress, response.output_item.added, response.content_part.added,
  response.output_text.delta (one per token), response.output_text.done, response.content_part.done,
  response.output_item.done, response.completed (an answer without tokens has no item events).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from vllm_etcd_proxy.sim.errors import ApiError, bad_request
from vllm_etcd_proxy.sim.protocol import messages as chat_messages

Messages = list[tuple[str, str]]
ECHOED = ("instructions", "metadata", "max_tool_calls", "previous_response_id", "prompt", "reasoning", "text", "user")
"""Request fields a response carries back as they were sent (default null)."""


def not_found(response_id: str) -> ApiError:
    """OpenAIServingResponses._make_not_found_error."""
    return ApiError(
        404, f"Response with id '{response_id}' not found.", type="invalid_request_error", param="response_id"
    )


@dataclass(frozen=True, kw_only=True)
class Turn:
    """A validated POST /v1/responses body."""

    id: str
    model: str | None
    input: Messages
    """This request's input as chat messages (the instructions not included)."""
    body: dict[str, Any]
    stream: bool
    store: bool
    background: bool
    previous_response_id: str | None
    max_output_tokens: int | None


def _input(value: Any) -> Messages:
    if isinstance(value, str):
        return [("user", value)]
    if not isinstance(value, list):
        raise bad_request("`input` must be a string or a list of input items.", "input")
    out: Messages = []
    for item in value:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item, dict):
            out += chat_messages([{"role": item.get("role"), "content": item.get("content")}])
        elif kind == "function_call_output" and isinstance(item, dict):
            out.append(("tool", str(item.get("output", ""))))
        elif kind is None:
            raise bad_request("Each input item must be an object.", "input")
    return out


def parse_turn(body: Any) -> Turn:
    """ResponsesRequest's validation, for the fields the simulator honours."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    if "input" not in body:
        raise bad_request("Field required: `input`.", "input")
    store = bool(body.get("store", True))  # null stores nothing, as vLLM's `if request.store`
    background = bool(body.get("background"))
    if background and not store:
        raise bad_request("background can only be used when `store` is true", "background")
    if body.get("prompt") is not None:
        raise bad_request("prompt template is not supported", "prompt")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    limit = body.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise bad_request("`max_output_tokens` must be a positive integer.", "max_output_tokens")
    rid, prev, model = body.get("request_id"), body.get("previous_response_id"), body.get("model")
    return Turn(
        id=rid if isinstance(rid, str) and rid else f"resp_{uuid.uuid4().hex}",
        model=model if isinstance(model, str) else None,
        input=_input(body["input"]),
        body=body,
        stream=bool(body.get("stream")),
        store=store,
        background=background,
        previous_response_id=prev if isinstance(prev, str) else None,
        max_output_tokens=limit,
    )


def conversation(turn: Turn, previous: Messages | None, previous_output: str | None) -> Messages:
    """The messages the prompt renders (construct_input_messages)."""
    instructions = turn.body.get("instructions")
    out: Messages = [("system", instructions)] if isinstance(instructions, str) and instructions else []
    out += [m for m in previous or [] if m[0] != "system"]
    if previous_output is not None:
        out.append(("assistant", previous_output))
    return out + turn.input


def output_text(response: dict[str, Any]) -> str:
    """The text of a response's output messages."""
    return "".join(
        part.get("text", "")
        for item in response.get("output", [])
        if item.get("type") == "message"
        for part in item.get("content", [])
    )


def usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "input_tokens_per_turn": [prompt],
            "cached_tokens_per_turn": [cached],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [output],
            "tool_output_tokens_per_turn": [0],
        },
        "total_tokens": prompt + output,
    }


def _part(text: str) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


def message_item(item_id: str, text: str | None) -> dict[str, Any]:
    """An output message: in progress and empty while ``text`` is None."""
    content = [] if text is None else [_part(text)]
    status = "in_progress" if text is None else "completed"
    return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message"}


def response_object(
    turn: Turn,
    *,
    model: str,
    created: int,
    status: str,
    max_tokens: int,
    output: list[dict[str, Any]],
    use: dict[str, Any] | None,
) -> dict[str, Any]:
    """ResponsesResponse.from_request, dumped (every field, nulls included)."""
    body = turn.body
    echoed = {name: body.get(name) for name in ECHOED}
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": turn.id,
        "created_at": created,
        "incomplete_details": incomplete,
        "instructions": echoed["instructions"],
        "metadata": echoed["metadata"],
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
        "background": turn.background,
        "max_output_tokens": max_tokens,
        "max_tool_calls": echoed["max_tool_calls"],
        "previous_response_id": echoed["previous_response_id"],
        "prompt": None,
        "reasoning": echoed["reasoning"],
        "service_tier": body.get("service_tier", "auto"),
        "status": status,
        "text": echoed["text"],
        "top_logprobs": None,
        "truncation": body.get("truncation") or "disabled",
        "usage": use,
        "user": echoed["user"],
        "input_messages": None,
        "output_messages": None,
    }


class Events:
    """Numbers one response's streamed events."""

    def __init__(self) -> None:
        self.sequence = 0

    def make(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def text_delta(self, item_id: str, delta: str) -> dict[str, Any]:
        return self.make(
            "response.output_text.delta", content_index=0, output_index=0, item_id=item_id, delta=delta, logprobs=[]
        )

    def opening(self, item_id: str) -> list[dict[str, Any]]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.make("response.output_item.added", output_index=0, item=message_item(item_id, None)),
            self.make("response.content_part.added", output_index=0, item_id=item_id, content_index=0, part=part),
        ]

    def closing(self, item_id: str, text: str) -> list[dict[str, Any]]:
        return [
            self.make(
                "response.output_text.done", output_index=0, content_index=0, text=text, logprobs=[], item_id=item_id
            ),
            self.make(
                "response.content_part.done",
                item_id=item_id,
                output_index=0,
                content_index=0,
                part={"text": text, "type": "output_text", "annotations": []},
            ),
            self.make("response.output_item.done", output_index=0, item=message_item(item_id, text)),
        ]

    def error(self, exc: ApiError) -> dict[str, Any]:
        """A failure after the stream started (OpenAI's ResponseErrorEvent)."""
        return self.make("error", code=str(exc.status), message=exc.message, param=exc.param)


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


def now() -> int:
    return int(time.time())
