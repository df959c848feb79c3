"""A request's prompt as token ids, and the index's block keys for it (computed once per request).

How a request becomes token ids is injected (``PromptIds``): this module reads only prompts that are token ids
already (``/v1/completions`` with ``prompt`` a list of ints, ``/inference/v1/generate`` with ``token_ids``);
text and chat need the model's tokenizer and chat template, which a ``PromptIds`` of its own provides, and may
give ``TokenIds`` that are worked out only as far as they are asked for (routing needs only the start of a long
prompt that no node holds any of). None means "unknown": the request is routed by content affinity as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

from vllm_etcd_proxy.proxy.kvcache.index import chain
from vllm_etcd_proxy.proxy.kvcache.prompt.prefix_ids import KeysTag

Kind = Literal["completion", "chat", "generate"]


class TokenIds(Protocol):
    """A prompt's ids, worked out as far as they are asked for (prefix_ids.py's ``ChatIds``)."""

    @property
    def complete(self) -> bool:
        """Whether every id is known already."""

    def head(self, count: int) -> Sequence[int]:
        """At least the first ``count`` ids, or all of them when the prompt has fewer."""

    def whole(self) -> Sequence[int]: ...

    def about(self) -> int:
        """About as many as all the ids (exactly when ``complete``), without tokenizing."""

    def known_keys(self, tag: KeysTag) -> list[int]:
        """Block keys of the prompt's first full blocks for ``tag`` that earlier prompts worked out (maybe none),
        in a list of the caller's own."""

    def keep_keys(self, tag: KeysTag, keys: Sequence[int]) -> None:
        """The keys of the prompt's first full blocks for ``tag``, for later prompts that begin as this one."""


PromptIds = Callable[[str, Mapping[str, Any], str], Sequence[int] | TokenIds | None]
"""(model, parsed JSON body, kind: "completion" | "chat" | "generate") -> the prompt's token ids, or None."""

MAX_PROMPT_IDS = 1 << 20
"""Ids read at most from one prompt: no model takes more, and a bigger list is no prompt."""


def _ids(value: object) -> Sequence[int] | None:
    if not isinstance(value, list) or not value or len(value) > MAX_PROMPT_IDS:
        return None
    for item in value:
        if not isinstance(item, int) or isinstance(item, bool):
            return None
    return value


def token_id_prompt(model: str, body: Mapping[str, Any], kind: str) -> Sequence[int] | None:
    """The default ``PromptIds``: prompts given as token ids; None for text and chat."""
    if kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch of one
        return _ids(prompt)
    if kind == "generate":
        return _ids(body.get("token_ids"))
    return None


KIND_OF_PATH: Mapping[str, Kind] = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
    "/inference/v1/generate": "generate",
}
"""The paths whose prompts the index can read, and how to read them."""


class _Given:
    """Ids known from the start (a token-id prompt, or one tokenized whole)."""

    __slots__ = ("_ids",)
    complete = True

    def __init__(self, ids: Sequence[int]) -> None:
        self._ids = ids

    def head(self, count: int) -> Sequence[int]:
        return self._ids

    def whole(self) -> Sequence[int]:
        return self._ids

    def about(self) -> int:
        return len(self._ids)

    def known_keys(self, tag: KeysTag) -> list[int]:
        return []

    def keep_keys(self, tag: KeysTag, keys: Sequence[int]) -> None:
        return None


class KvPrompt:
    """One request's token ids, with their block keys per (block size, adapter), computed when first asked.
    ``salt``: the request's ``cache_salt`` ("": none), which vLLM mixes into its first block's hash."""

    __slots__ = ("model", "salt", "_source", "_keys")

    def __init__(self, ids: Sequence[int] | TokenIds, model: str, salt: str = "") -> None:
        self._source: TokenIds = _Given(ids) if isinstance(ids, Sequence) else ids
        self.model = model
        self.salt = salt
        self._keys: dict[KeysTag, list[int]] = {}

    @property
    def ids(self) -> Sequence[int]:
        """All the prompt's ids (tokenizing the rest of it if it was read only in part)."""
        return self._source.whole()

    @property
    def complete(self) -> bool:
        """Whether all the ids are known (else only some first ones were asked for)."""
        return self._source.complete

    def head(self, count: int) -> Sequence[int]:
        """At least the first ``count`` ids, or all of them when the prompt has fewer."""
        return self._source.head(count)

    def about(self) -> int:
        """About as many as all the ids (exactly when ``complete``), without tokenizing any more of them."""
        return self._source.about()

    def keys(self, block_size: int, lora: str = "", within: int | None = None) -> list[int]:
        """The keys of the prompt's full blocks that a node may have cached: all but a last block that ends at
        the prompt's end (vLLM always computes the last prompt token, so that block is never a hit). With
        ``within``, those of the blocks in the ids known once its first ``within`` tokens are, while the rest
        of the prompt is not known (all of them once it is). Keys worked out once are kept and gone on from,
        and so are those an earlier prompt that began the same left with the cached pieces of a chat."""
        tag, source = (block_size, lora, self.salt), self._source
        keys = self._keys.get(tag)
        if keys is None:
            keys = self._keys[tag] = source.known_keys(tag)
        ids = source.whole() if within is None else source.head(within + 1)
        count = (len(ids) - 1) // block_size
        if within is not None and not source.complete:
            count = min(count, within // block_size)
        if len(keys) < count:
            keys += chain(ids, block_size, lora, count, self.salt, after=keys)
            source.keep_keys(tag, keys)
        return keys if len(keys) == count else keys[:count]


def read_prompt(prompt_ids: PromptIds, model: str, path: str, body: Mapping[str, Any]) -> KvPrompt | None:
    """The request's prompt for the index, or None (not a path it reads, or its ids unknown)."""
    kind = KIND_OF_PATH.get(path)
    if kind is None:
        return None
    ids = prompt_ids(model, body, kind)
    if ids is None:
        return None
    salt = body.get("cache_salt")
    prompt = KvPrompt(ids, model, salt if isinstance(salt, str) else "")
    return prompt if prompt.head(1) else None
