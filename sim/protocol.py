"""vLLM's OpenAI-compatible wire format (0.10/0.11): request parsing and response bodies, without any I/O.

Field sets and their order follow vllm/entrypoints/openai/protocol.py; which fields appear follows how
serving_completion.py / serving_chat.py serialise them: non-streamed bodies are ``model_dump()`` (every field,
nulls included), completion chunks ``exclude_unset=False``, chat chunks ``exclude_unset=True``, and the final
usage-only chunk additionally ``exclude_none=True``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sim.errors import ApiError, bad_request


class Kind(StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"


@dataclass(frozen=True, kw_only=True)
class GenRequest:
    """What the simulator needs from a /v1/completions or /v1/chat/completions body."""

    kind: Kind
    model: str | None
    """The requested name; None means the first served model, as in vLLM."""
    prompt_tokens: int
    max_tokens: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    kv_transfer_params: dict[str, Any] | None
    body_request_id: str | None


def dumps(obj: Any) -> str:
    """Compact JSON, as pydantic's model_dump_json and starlette's JSONResponse write it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _words(text: str) -> int:
    return len(text.split())


def _count_prompt(prompt: Any) -> int:
    if isinstance(prompt, str):
        return _words(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if len(prompt) == 1:
            return _count_prompt(prompt[0])
        raise bad_request("vllm-sim serves one prompt per request; send batches as separate requests", "prompt")
    raise bad_request("At least one of `prompt` or `prompt_embeds` must be set.", "prompt")


def _count_messages(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list of messages.", "messages")
    words = 0
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("Each message must be an object with a `role`.", "messages")
        content = message.get("content")
        if isinstance(content, str):
            words += _words(content)
        elif isinstance(content, list):
            words += sum(_words(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return words


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad_request(f"`{key}` must be a positive integer.", key)
    return value


def parse(kind: Kind, body: Any) -> GenRequest:
    """Validate a request body the way vLLM's pydantic models do (the subset the simulator honours)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("`model` must be a string.", "model")
    if kind is Kind.COMPLETION:
        prompt_tokens = _count_prompt(body.get("prompt"))
        max_tokens = _opt_int(body, "max_tokens")
    else:
        prompt_tokens = _count_messages(body.get("messages"))
        # serving_chat: max_completion_tokens wins over the deprecated max_tokens.
        max_tokens = _opt_int(body, "max_completion_tokens") or _opt_int(body, "max_tokens")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean.", "stream")
    stream_options = body.get("stream_options")
    if stream_options and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("`stream_options` must be an object.", "stream_options")
    # StreamOptions.include_usage defaults to True once stream_options is present at all.
    include_usage = stream_options is not None and bool(stream_options.get("include_usage", True))
    continuous = include_usage and bool((stream_options or {}).get("continuous_usage_stats", False))
    n = body.get("n")
    if n not in (None, 1):
        raise bad_request("vllm-sim supports only n=1.", "n")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise bad_request("`kv_transfer_params` must be an object.", "kv_transfer_params")
    request_id = body.get("request_id")
    return GenRequest(
        kind=kind,
        model=model,
        prompt_tokens=max(1, prompt_tokens),
        max_tokens=max_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        kv_transfer_params=kv,
        body_request_id=request_id if isinstance(request_id, str) and request_id else None,
    )


def check_model(requested: str | None, served: tuple[str, ...]) -> None:
    if requested is not None and requested not in served:
        raise ApiError(404, f"The model `{requested}` does not exist.", param="model")


def check_context(req: GenRequest, max_model_len: int) -> None:
    """Prompt plus max_tokens must fit the context, as vLLM checks before scheduling."""
    wanted = req.prompt_tokens + (req.max_tokens or 0)
    if req.prompt_tokens >= max_model_len or wanted > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {wanted} "
            f"tokens ({req.prompt_tokens} in the messages, {req.max_tokens or 0} in the completion). "
            "Please reduce the length of the messages or completion.",
            "max_tokens" if req.prompt_tokens < max_model_len else None,
        )


def token_text(i: int) -> str:
    """The deterministic text of generated token ``i``: the output reads ``tok0 tok1 tok2 ...``."""
    return f"tok{i}" if i == 0 else f" tok{i}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


class Wire:
    """Builds one response's bodies and SSE events. ``rid`` is the X-Request-Id header, else a new hex id."""

    def __init__(self, kind: Kind, rid: str | None, model: str):
        self.kind = kind
        prefix = "cmpl" if kind is Kind.COMPLETION else "chatcmpl"
        self.id = f"{prefix}-{rid or uuid.uuid4().hex}"
        # The engine's own request id: completions number their prompts (serving_completion.py).
        self.engine_request_id = f"{self.id}-0" if kind is Kind.COMPLETION else self.id
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish: str, use: dict[str, Any], kv: dict[str, Any] | None) -> dict[str, Any]:
        """The non-streamed body (CompletionResponse / ChatCompletionResponse)."""
        if self.kind is Kind.COMPLETION:
            choice: dict[str, Any] = {
                "index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
            }  # fmt: skip
            tail: dict[str, Any] = {}
        else:
            message: dict[str, Any] = {
                "role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                "function_call": None, "tool_calls": [], "reasoning_content": None,
            }  # fmt: skip
            choice = {
                "index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                "token_ids": None,
            }  # fmt: skip
            tail = {"prompt_logprobs": None, "prompt_token_ids": None}
        obj = "text_completion" if self.kind is Kind.COMPLETION else "chat.completion"
        return {
            **self._head(obj), "choices": [choice], "service_tier": None, "system_fingerprint": None,
            "usage": use, **tail, "kv_transfer_params": kv,
        }  # fmt: skip

    def role_event(self) -> str | None:
        """Chat streams open with an empty assistant delta; completion streams have no such event."""
        if self.kind is Kind.COMPLETION:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._event({**self._head("chat.completion.chunk"), "choices": [choice], "prompt_token_ids": None})

    def token_event(self, text: str, finish: str | None, use: dict[str, Any] | None) -> str:
        """One generated token; the last one carries finish_reason (and stop_reason)."""
        if self.kind is Kind.COMPLETION:
            choice: dict[str, Any] = {
                "index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                "prompt_token_ids": None, "token_ids": None,
            }  # fmt: skip
            return self._event({**self._head("text_completion"), "choices": [choice], "usage": use})
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
        chunk: dict[str, Any] = {**self._head("chat.completion.chunk"), "choices": [choice]}
        if use is not None:
            chunk["usage"] = use
        return self._event(chunk)

    def usage_event(self, use: dict[str, Any]) -> str:
        """The final ``choices: []`` chunk of stream_options.include_usage (nulls dropped)."""
        obj = "text_completion" if self.kind is Kind.COMPLETION else "chat.completion.chunk"
        trimmed = {k: v for k, v in use.items() if v is not None}
        return self._event({**self._head(obj), "choices": [], "usage": trimmed})

    @staticmethod
    def error_event(error: ApiError) -> str:
        """How vLLM reports a failure after the stream started (create_streaming_error_response)."""
        return Wire._event(error.body())

    @staticmethod
    def _event(obj: Any) -> str:
        return f"data: {dumps(obj)}\n\n"


DONE_EVENT = "data: [DONE]\n\n"


def model_list(served: tuple[str, ...], max_model_len: int) -> dict[str, Any]:
    """GET /v1/models: ModelList of ModelCard, each with one ModelPermission, as vLLM's serving_models."""
    now = int(time.time())
    cards = []
    for name in served:
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": now,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False,
        }  # fmt: skip
        cards.append({
            "id": name, "object": "model", "created": now, "owned_by": "vllm", "root": served[0],
            "parent": None, "max_model_len": max_model_len, "permission": [permission],
        })  # fmt: skip
    return {"object": "list", "data": cards}
