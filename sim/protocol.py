"""vLLM's OpenAI-compatible requests (0.10/0.11): validating /v1/completions, /v1/chat/completions and /tokenize
bodies into token ids, without any I/O. Response bodies are in ``wire``.

Field sets and checks follow vllm/entrypoints/openai/protocol.py and the preprocessing of serving_chat.py /
serving_completion.py; prompts become ids with the simulated tokenizer and chat template (``tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from vllm_etcd_proxy.sim import tokens
from vllm_etcd_proxy.sim.errors import ApiError, bad_request

BOTH_PROMPT_FLAGS = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
"""ChatCompletionRequest.check_generation_prompt, when both are sent as true."""
_TEMPLATE_CONFLICT = (
    "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when you want "
    "the model to continue the final message, and add_generation_prompt when you want to add a header that will "
    "prompt it to start a new assistant message instead."
)
TEMPLATE_CONFLICT = f"{_TEMPLATE_CONFLICT} {_TEMPLATE_CONFLICT}"
"""continue_final_message with add_generation_prompt left to its default (true): the validator reads the raw body
and lets it through, transformers' apply_chat_template raises, vLLM re-raises it as a ValueError from the original
and answers 400 with ``f"{e} {e.__cause__}"``, hence the message twice."""


class Kind(StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"


@dataclass(frozen=True, kw_only=True)
class GenRequest:
    """What the simulator needs from a /v1/completions or /v1/chat/completions body."""

    kind: Kind
    model: str | None
    """The requested name; None means the first served model, as in vLLM."""
    prompt_ids: tuple[int, ...]
    """The prompt as the engine sees it: tokenized text, the ids sent, or the rendered chat."""
    max_tokens: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    kv_transfer_params: dict[str, Any] | None
    body_request_id: str | None
    return_token_ids: bool
    role: str = "assistant"
    """The answer's role: the last message's when add_generation_prompt is false (get_chat_request_role)."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def _token_list(value: Any) -> list[int] | None:
    """``value`` as token ids if it is a non-empty list of ints; an id outside the vocabulary is a 400."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    bad = next((t for t in value if not tokens.in_vocab(t)), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} is out of vocabulary", "prompt")
    return list(value)


def prompt_ids(prompt: Any, encoder: tokens.Encoder = tokens.encode) -> list[int]:
    """A completions ``prompt``: text, token ids, or a batch of one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encoder(prompt)
    ids = _token_list(prompt)
    if ids is not None:
        return ids
    if isinstance(prompt, list) and prompt:
        raise bad_request("vllm-sim serves one prompt per request; send batches as separate requests", "prompt")
    raise bad_request("At least one of `prompt` or `prompt_embeds` must be set.", "prompt")


def messages(value: Any) -> list[tuple[str, str]]:
    """``(role, text)`` pairs; text parts of a content list are joined with newlines, other parts are dropped."""
    if not isinstance(value, list) or not value:
        raise bad_request("`messages` must be a non-empty list of messages.", "messages")
    out = []
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("Each message must be an object with a `role`.", "messages")
        content = message.get("content")
        if content is None or isinstance(content, str):
            text = content or ""
        elif isinstance(content, list):
            text = "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        else:
            raise bad_request("A message's `content` must be a string or a list of content parts.", "messages")
        out.append((message["role"], text))
    return out


def _opt_bool(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"`{key}` must be a boolean.", key)
    return value


def render_messages(body: dict[str, Any], encoder: tokens.Encoder = tokens.encode) -> tuple[list[int], str]:
    """A chat body's prompt ids and the answer's role, applying add_generation_prompt / continue_final_message."""
    add = _opt_bool(body, "add_generation_prompt")
    continue_final = bool(_opt_bool(body, "continue_final_message"))
    if continue_final and add:
        raise bad_request(BOTH_PROMPT_FLAGS)
    chat = messages(body.get("messages"))
    if continue_final and add is None:
        raise ApiError(400, TEMPLATE_CONFLICT)
    add = add is not False
    ids = tokens.render_chat(chat, add_generation_prompt=add, continue_final_message=continue_final, encoder=encoder)
    return ids, "assistant" if add else chat[-1][0]


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad_request(f"`{key}` must be a positive integer.", key)
    return value


def parse(kind: Kind, body: Any, encoder: tokens.Encoder = tokens.encode) -> GenRequest:
    """Validate a request body the way vLLM's pydantic models do (the subset the simulator honours)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("`model` must be a string.", "model")
    role = "assistant"
    if kind is Kind.COMPLETION:
        ids = prompt_ids(body.get("prompt"), encoder)
        max_tokens = _opt_int(body, "max_tokens")
    else:
        ids, role = render_messages(body, encoder)
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
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    request_id = body.get("request_id")
    return GenRequest(
        kind=kind,
        model=model,
        prompt_ids=tuple(ids),
        max_tokens=max_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        kv_transfer_params=kv,
        body_request_id=request_id if isinstance(request_id, str) and request_id else None,
        return_token_ids=bool(_opt_bool(body, "return_token_ids")),
        role=role,
    )


def check_model(requested: Any, served: tuple[str, ...]) -> None:
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


def tokenize_ids(body: Any, encoder: tokens.Encoder = tokens.encode) -> list[int]:
    """POST /tokenize: TokenizeChatRequest when ``messages`` is present, else TokenizeCompletionRequest."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    if "messages" in body:
        return render_messages(body, encoder)[0]
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("`prompt` must be a string.", "prompt")
    return encoder(prompt)


def detokenize_ids(body: Any) -> list[int]:
    """POST /detokenize: ``tokens`` must be ids in the vocabulary."""
    ids = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(tokens.in_vocab(t) for t in ids):
        raise bad_request(f"`tokens` must be a list of token ids below {tokens.VOCAB_SIZE}.", "tokens")
    return ids
