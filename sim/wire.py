"""vLLM's OpenAI-compatible response bodies and SSE events (0.10/0.11), without any I/O.

Field sets and their order follow vllm/entrypoints/openai/protocol.py; which fields appear follows how
serving_completion.py / serving_chat.py serialise them: non-streamed bodies are ``model_dump()`` (every field,
nulls included), completion chunks ``exclude_unset=False``, chat chunks ``exclude_unset=True``, and the final
usage-only chunk additionally ``exclude_none=True``.

``return_token_ids`` places the ids as vLLM does: completions carry ``prompt_token_ids`` and ``token_ids`` on
the choice (streamed: prompt ids on the first chunk only, token ids on every chunk); chat carries the prompt ids
at the top level (streamed: on the role chunk only) and ``token_ids`` on the choice.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from vllm_etcd_proxy.sim.errors import ApiError
from vllm_etcd_proxy.sim.protocol import GenRequest, Kind
from vllm_etcd_proxy.sim.tokens import decode

DONE_EVENT = "data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    """Compact JSON, as pydantic's model_dump_json and starlette's JSONResponse write it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


class Wire:
    """Builds one response's bodies and SSE events. ``rid`` is the X-Request-Id header, else a new hex id."""

    def __init__(self, req: GenRequest, rid: str | None, model: str):
        self.kind = req.kind
        self.role = req.role
        self.with_ids = req.return_token_ids
        self.prompt_ids = list(req.prompt_ids)
        prefix = "cmpl" if self.kind is Kind.COMPLETION else "chatcmpl"
        self.id = f"{prefix}-{rid or uuid.uuid4().hex}"
        # The engine's own request id: completions number their prompts (serving_completion.py).
        self.engine_request_id = f"{self.id}-0" if self.kind is Kind.COMPLETION else self.id
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _ids(self, ids: Sequence[int]) -> list[int] | None:
        return list(ids) if self.with_ids else None

    def full(
        self, generated: Sequence[int], finish: str, use: dict[str, Any], kv: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The non-streamed body (CompletionResponse / ChatCompletionResponse)."""
        text = decode(generated)
        if self.kind is Kind.COMPLETION:
            choice: dict[str, Any] = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": self._ids(generated),
                "prompt_logprobs": None,
                "prompt_token_ids": self._ids(self.prompt_ids),
            }
            tail: dict[str, Any] = {}
        else:
            message: dict[str, Any] = {
                "role": self.role,
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning_content": None,
            }
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": self._ids(generated),
            }
            tail = {"prompt_logprobs": None, "prompt_token_ids": self._ids(self.prompt_ids)}
        obj = "text_completion" if self.kind is Kind.COMPLETION else "chat.completion"
        return {
            **self._head(obj),
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": use,
            **tail,
            "kv_transfer_params": kv,
        }

    def role_event(self, use: dict[str, Any] | None) -> str | None:
        """Chat streams open with an empty delta in the answer's role, carrying the prompt ids when asked;
        completion streams have no such event."""
        if self.kind is Kind.COMPLETION:
            return None
        choice = {"index": 0, "delta": {"role": self.role, "content": ""}, "logprobs": None, "finish_reason": None}
        chunk: dict[str, Any] = {
            **self._head("chat.completion.chunk"),
            "choices": [choice],
            "prompt_token_ids": self._ids(self.prompt_ids),
        }
        if use is not None:
            chunk["usage"] = use
        return self._event(chunk)

    def token_event(self, ids: Sequence[int], finish: str | None, use: dict[str, Any] | None, first: bool) -> str:
        """Generated tokens (one, or none on an answer that ends at once); the last event carries finish_reason."""
        text = decode(ids)
        if self.kind is Kind.COMPLETION:
            choice: dict[str, Any] = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_token_ids": self._ids(self.prompt_ids) if first else None,
                "token_ids": self._ids(ids),
            }
            return self._event({**self._head("text_completion"), "choices": [choice], "usage": use})
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = self._ids(ids)
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


def _permission(now: int) -> dict[str, Any]:
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": now,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def model_list(
    served: tuple[str, ...], max_model_len: int, root: str, loras: dict[str, str], parents: dict[str, str] | None = None
) -> dict[str, Any]:
    """GET /v1/models: ModelList of ModelCard, each with one ModelPermission, as vLLM's serving_models: base
    models carry ``root`` (the model path) and ``max_model_len``; LoRA adapters their path as ``root``, the first
    served name as ``parent`` and no ``max_model_len``."""
    now = int(time.time())
    cards = [
        {
            "id": name,
            "object": "model",
            "created": now,
            "owned_by": "vllm",
            "root": root,
            "parent": None,
            "max_model_len": max_model_len,
            "permission": [_permission(now)],
        }
        for name in served
    ]
    cards += [
        {
            "id": name,
            "object": "model",
            "created": now,
            "owned_by": "vllm",
            "root": path,
            "parent": (parents or {}).get(name, served[0]),
            "max_model_len": None,
            "permission": [_permission(now)],
        }
        for name, path in loras.items()
    ]
    return {"object": "list", "data": cards}
