"""Resuming a stream on another node when its node fails after tokens reached the client.

While a resumable stream is relayed, the proxy forwards whole SSE events only and keeps them (``StreamLog``);
that is all it does per chunk. When the node fails (connection broken, idle timeout, an error event, an end
without ``[DONE]``), the kept events are parsed once, and a continuation goes to another node through the normal
routing:

- ``/v1/completions``: the prompt plus what was generated, as token ids when the stream carried them (the client
  asked for ``return_token_ids``), else as text; ``max_tokens`` (and ``min_tokens``) reduced by the tokens sent;
- ``/v1/chat/completions``: the messages plus the partial assistant message, with ``continue_final_message: true``
  and ``add_generation_prompt: false``.

The continuation's events are rewritten to look like the rest of the same response (the first answer's ``id``,
``created`` and ``model``; no second role chunk or prompt ids; ``usage`` counting the whole answer) before they
go to the client. Which requests are not resumed, and why, is ``not_resumable``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from vllm_etcd_proxy.proxy.errors import UpstreamFailed

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
DONE = b"data: [DONE]\n\n"
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "tools", "functions")


class NodeErrorEvent(UpstreamFailed):
    """The node reported a failure in the stream itself (an ``error`` event)."""


def not_resumable(path: str, body: Mapping[str, Any]) -> str | None:
    """Why a stream of this request must not be resumed on another node, or None when it may be."""
    if path not in (CHAT, COMPLETIONS) or body.get("stream") is not True:
        return "not a streamed completion"
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n or best_of > 1"
    if path == COMPLETIONS:
        if body.get("logprobs") is not None or body.get("echo"):
            return "logprobs or echo"
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) and not _is_ids(prompt):
            return "a batch of prompts"
    elif body.get("logprobs") and body.get("top_logprobs"):
        return "logprobs with top_logprobs"
    if any(body.get(name) for name in _GUIDED) or body.get("tool_choice") not in (None, "none"):
        return "guided decoding or tools"
    response_format = body.get("response_format")
    if response_format is not None and not (
        isinstance(response_format, dict) and response_format.get("type") in (None, "text")
    ):
        return "a response_format"
    return None


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


class StreamLog:
    """The SSE events a client has received, whole events only, in order."""

    __slots__ = ("_parts", "done", "_tail", "writes")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._tail = b""
        self.done = False
        """``[DONE]`` was received: the answer is complete."""
        self.writes = 0
        """Body writes to the client so far."""

    def cut(self, chunk: bytes) -> bytes:
        """The whole events in what has arrived so far (this ``chunk`` after any partial event kept from the
        last); the partial event at the end, if any, is kept for the next call."""
        if self._tail:
            chunk = self._tail + chunk
        end = chunk.rfind(b"\n\n") + 2
        if end == 1:
            self._tail = chunk
            return b""
        self._tail = chunk[end:]
        return chunk[:end] if self._tail else chunk

    def drop_partial(self) -> None:
        """Forget the partial event kept from a node that failed (the client never got it)."""
        self._tail = b""

    def tail(self) -> bytes:
        """The last two writes: where the answer's ``usage`` event is."""
        return b"".join(self._parts[-2:])

    def add(self, events: bytes) -> None:
        self._parts.append(events)
        self.writes += 1
        if events.endswith(DONE):
            self.done = True

    def events(self) -> list[dict[str, Any]]:
        """The JSON events received, parsed (``[DONE]`` and anything unparsable left out)."""
        parsed = []
        for event in b"".join(self._parts).split(b"\n\n"):
            if event.startswith(b"data: {"):
                try:
                    obj = orjson.loads(event[6:])
                except orjson.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    parsed.append(obj)
        return parsed


def error_event_at(events: bytes) -> int:
    """Where an ``error`` event starts in ``events`` (whole events), or -1."""
    if b'{"error"' not in events:
        return -1
    at = events.find(b'data: {"error"')
    if at > 0 and events[at - 2 : at] != b"\n\n":
        return -1
    return at


@dataclass(kw_only=True)
class Progress:
    """What the client has of the answer, read from the events it received."""

    id: str | None = None
    created: int | None = None
    model: str | None = None
    text: str = ""
    ids: list[int] = field(default_factory=list)
    ids_seen: bool = False
    prompt_ids: list[int] | None = None
    tokens: int = 0
    finish_reason: str | None = None


def progress(path: str, log: StreamLog) -> Progress:
    """What the client received of the answer (its first choice), from the events it got."""
    found = Progress()
    for obj in log.events():
        if found.id is None and isinstance(obj.get("id"), str):
            found.id, found.created, found.model = obj["id"], obj.get("created"), obj.get("model")
        if isinstance(obj.get("prompt_token_ids"), list):
            found.prompt_ids = obj["prompt_token_ids"]
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                _add_choice(found, path, choice)
    return found


def _add_choice(found: Progress, path: str, choice: dict[str, Any]) -> None:
    """One event's first choice added to ``found``: its text, its token ids (or a token counted per piece)."""
    if path == CHAT:
        delta = choice.get("delta") or {}
        piece = delta.get("content") if isinstance(delta, dict) else None
    else:
        piece = choice.get("text")
        if isinstance(choice.get("prompt_token_ids"), list):
            found.prompt_ids = choice["prompt_token_ids"]
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        found.ids_seen = True
        found.ids += ids
        found.tokens += len(ids)
    elif isinstance(piece, str) and piece:
        found.tokens += 1
    if isinstance(piece, str):
        found.text += piece
    if choice.get("finish_reason"):
        found.finish_reason = choice["finish_reason"]


def continuation_body(path: str, body: Mapping[str, Any], done: Progress) -> dict[str, Any] | None:
    """The request that generates the rest of the answer, or None when nothing is left to generate."""
    if done.finish_reason is not None:
        return None
    leg = _fewer_tokens(body, done.tokens)
    if leg is None or not done.tokens:
        return leg
    if path == COMPLETIONS:
        leg["prompt"] = _continued_prompt(body.get("prompt"), done)
        return leg
    messages = list(body.get("messages") or [])
    last = messages[-1] if messages else None
    if body.get("continue_final_message") and isinstance(last, dict) and isinstance(last.get("content"), str):
        messages[-1] = {**last, "content": last["content"] + done.text}
    else:
        messages.append({"role": "assistant", "content": done.text})
    leg["messages"] = messages
    leg["continue_final_message"] = True
    leg["add_generation_prompt"] = False
    return leg


def _fewer_tokens(body: Mapping[str, Any], sent: int) -> dict[str, Any] | None:
    """``body`` with its token budgets less the ``sent`` tokens; None when its maximum is used up."""
    leg = dict(body)
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(leg.get(name), int):
            left = leg[name] - sent
            if left <= 0:
                return None
            leg[name] = left
    for name in ("min_tokens", "min_completion_tokens"):
        if isinstance(leg.get(name), int):
            leg[name] = max(0, leg[name] - sent)
    return leg


def _continued_prompt(prompt: Any, done: Progress) -> Any:
    """A completion's prompt and what was generated: as token ids when the stream carried them, else as text."""
    prompt_ids: list[int] | None = prompt if _is_ids(prompt) else done.prompt_ids
    if done.ids_seen and prompt_ids:
        return [*prompt_ids, *done.ids]
    if isinstance(prompt, list):
        return [prompt[0] + done.text] if prompt and isinstance(prompt[0], str) else prompt
    return f"{prompt}{done.text}"


class Splice:
    """Rewrites a continuation's events into the ongoing answer's."""

    def __init__(self, path: str, done: Progress) -> None:
        self._chat = path == CHAT
        self._done = done
        self._role_skipped = False
        self.failed: NodeErrorEvent | None = None
        """Set when the continuation's node reported an error, or sent an event that is not a JSON object: what
        came before it is still returned."""

    def __call__(self, events: bytes) -> bytes:
        """The events to send on, up to an error event if the node reports one (see ``failed``)."""
        out = []
        for event in events.split(b"\n\n"):
            if not event:
                continue
            if not event.startswith(b"data: {"):
                out.append(event + b"\n\n")
                continue
            try:
                obj = orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict):
                # The stream's node is broken: what came before is sent, and the stream goes on from another.
                self.failed = NodeErrorEvent("the node sent an event that is not a JSON object")
                break
            if "error" in obj and "choices" not in obj:
                self.failed = NodeErrorEvent(f"the node reported an error: {obj['error']}")
                break
            rewritten = self._rewrite(obj)
            if rewritten is not None:
                out.append(b"data: " + orjson.dumps(rewritten) + b"\n\n")
        return b"".join(out)

    def _rewrite(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        done = self._done
        if done.id is not None:
            obj["id"], obj["created"], obj["model"] = done.id, done.created, done.model
        choices = obj.get("choices") or []
        if self._chat and not self._role_skipped and choices:
            delta = choices[0].get("delta") or {}
            if "role" in delta and not delta.get("content"):
                self._role_skipped = True
                return None  # the client has had its role chunk from the first node
        if "prompt_token_ids" in obj:
            obj["prompt_token_ids"] = None  # the client has had the prompt's ids, if it asked, from the first node
        for choice in choices:
            if isinstance(choice, dict) and "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            prompt = usage["prompt_tokens"] - done.tokens
            completion = (usage.get("completion_tokens") or 0) + done.tokens
            usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        return obj
