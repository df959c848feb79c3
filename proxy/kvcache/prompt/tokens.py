"""The token ids a node will see for a request, for routing on what nodes hold cached (``PromptTokens``).

Where a model's tokenizer comes from: ``--tokenizer MODEL=PATH_OR_HUB_ID`` (a directory with ``tokenizer.json``,
that file itself, or a Hugging Face hub id, fetched only when given so), else the ``root`` of the model's card
in a node's ``/v1/models`` when it is a local directory with a ``tokenizer.json`` (a LoRA adapter's card without
one: its ``parent``'s). The directory's ``tokenizer_config.json`` (or ``chat_template.jinja``) gives the chat
template and the special tokens the template reads. Tokenizers load in a worker thread, off the event loop;
until one is loaded its model's requests have no ids.

What the node sees, as vLLM builds it: a completions text prompt is tokenized with the tokenizer's special
tokens (``add_special_tokens``, default true); token-id prompts (and ``/inference/v1/generate``'s ``token_ids``)
are taken as they are; a chat is rendered by the template (``chat_template``) and tokenized without them (its
``add_special_tokens`` defaults to false), piece by piece as far as routing asks, reusing the pieces of earlier
prompts that began with the same text (``prefix_ids``).

Anything that cannot be known (no tokenizer, a template error, a body vLLM would refuse, media content) is
``None``: the router falls back to content affinity. Each reason is logged once per model; every call counts in
``vllm_proxy_prompt_tokenize_total{outcome}``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from prometheus_client import CollectorRegistry, Counter, Gauge
from tokenizers import Tokenizer

from vllm_etcd_proxy.fleet.vllm import ModelCard
from vllm_etcd_proxy.proxy.discovery.state import NodeState
from vllm_etcd_proxy.proxy.kvcache.prompt.chat_template import ChatTemplate, Unsupported
from vllm_etcd_proxy.proxy.kvcache.prompt.ids import TokenIds
from vllm_etcd_proxy.proxy.kvcache.prompt.prefix_ids import CACHE_TOKENS, ChatIds, PrefixIds, Splitter, token_ids

log = logging.getLogger(__name__)

RETRY_AFTER = 30.0
"""Seconds before a model without a tokenizer (or whose tokenizer failed to load) is looked up again."""
MAX_MODELS = 4096
"""Model names remembered (lookups, warnings given): they come from requests."""
CHECKED_SPLITS = 4
"""Chats per model whose ids, worked out in pieces, are also checked against tokenizing whole."""
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_SAMPLE_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Count to 3."},
]


@dataclass(kw_only=True, eq=False)
class Loaded:
    """One tokenizer directory, ready: the tokenizer, its chat templates by name and the prefix splitter."""

    source: str
    tokenizer: Tokenizer
    templates: Mapping[str, ChatTemplate]
    splitter: Splitter | None
    """None when cutting the text would change the ids (then chats are tokenized whole)."""
    checks_left: int = CHECKED_SPLITS

    def template(self, tools: Any) -> ChatTemplate | None:
        """transformers' choice among named templates: ``tool_use`` for a request with tools, else ``default``."""
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.templates.get("default")


def _files(source: str) -> tuple[Path, Path | None, Path | None]:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja of a local source, else from the hub."""
    path = Path(source).expanduser()
    if path.is_file():
        path = path.parent
    if path.is_dir():
        config, jinja = path / "tokenizer_config.json", path / "chat_template.jinja"
        return path / "tokenizer.json", config if config.is_file() else None, jinja if jinja.is_file() else None
    from huggingface_hub import hf_hub_download  # only for a hub id given with --tokenizer

    def optional(name: str) -> Path | None:
        try:
            return Path(hf_hub_download(source, name))
        except Exception:  # noqa: BLE001 - absent from the repository, or the hub unreachable
            return None

    return (
        Path(hf_hub_download(source, "tokenizer.json")),
        optional("tokenizer_config.json"),
        optional("chat_template.jinja"),
    )


def load(source: str) -> Loaded:
    """Read a tokenizer directory (see the module docstring); raises what reading or parsing raised."""
    tokenizer_file, config_file, jinja_file = _files(source)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file else {}
    special: dict[str, Any] = {}
    for key in _SPECIAL_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[key] = value
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):  # strings, or AddedToken objects as tokenizer_config.json spells them
        special["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
    raw = jinja_file.read_text(encoding="utf-8") if jinja_file else config.get("chat_template")
    if isinstance(raw, str):
        named = {"default": raw}
    else:  # a list of named templates
        named = {
            t["name"]: t["template"] for t in raw or () if isinstance(t, dict) and isinstance(t.get("template"), str)
        }
    templates = {name: ChatTemplate(text, special) for name, text in named.items()}
    splitter = Splitter.checked(tokenizer, _samples(tokenizer, templates.values()))
    return Loaded(source=source, tokenizer=tokenizer, templates=templates, splitter=splitter)


def _samples(tokenizer: Tokenizer, templates: Iterable[ChatTemplate]) -> list[str]:
    """Rendered chats to check cuts on: plain words, and words of the tokenizer's own vocabulary (which plain
    words may not be: unknown words all look alike)."""
    size = tokenizer.get_vocab_size()
    known = tokenizer.decode(list(range(0, size, max(1, size // 48))), skip_special_tokens=True)
    chats = [_SAMPLE_CHAT, [{**m, "content": f"{known} {m['content']}"} for m in _SAMPLE_CHAT]]
    try:
        return [t.render({"messages": chat}) for t in templates for chat in chats]
    except Exception:  # noqa: BLE001 - a template that refuses the samples: no incremental ids, chats still work
        return []


class PromptTokens:
    """``ids(model, body, kind)``: the ids of the module docstring (a chat's worked out as far as they are asked
    for), or None; ``prompt_ids``: all of them at once."""

    def __init__(
        self,
        sources: Mapping[str, str],
        cards: Callable[[str], Sequence[ModelCard]],
        registry: CollectorRegistry,
        *,
        cache_tokens: int = CACHE_TOKENS,
    ) -> None:
        self._sources = dict(sources)
        self._cards = cards
        self._outcomes = Counter(
            "vllm_proxy_prompt_tokenize",
            "Requests turned into token ids for routing, by outcome: ids (token ids "
            "given), whole, incremental (ids of earlier prompts reused), loading, no_tokenizer, unsupported, failed.",
            ["outcome"],
            registry=registry,
        )
        tokens = Counter(
            "vllm_proxy_prompt_ids",
            "Prompt token ids worked out for routing: tokenized, or reused from earlier prompts that began alike "
            "(a long prompt no node holds any of is tokenized only as far as routing needs).",
            ["source"],
            registry=registry,
        )
        self._counts = (tokens.labels("tokenized"), tokens.labels("reused"))
        self._cache = PrefixIds(cache_tokens)
        self._reuse = cache_tokens > 0
        """False: every chat is tokenized whole (``cache_tokens=0``)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-load")
        self._resolved: dict[str, tuple[str | None, tuple[tuple[Any, Any], ...], float]] = {}
        self._loads: dict[str, Future[Loaded]] = {}
        self._failed: dict[str, float] = {}
        self._warned: set[tuple[str, str]] = set()
        loaded = Gauge(
            "vllm_proxy_tokenizers_loaded",
            "Tokenizers loaded for routing on KV-cache events (from --tokenizer, or a model card's local root).",
            registry=registry,
        )
        loaded.set_function(lambda: sum(1 for f in list(self._loads.values()) if f.done() and not f.exception()))

    def start(self) -> None:
        """Begin loading the tokenizers named by --tokenizer."""
        for source in set(self._sources.values()):
            self._load(source)

    def node_seen(self, state: NodeState) -> None:
        """A node came or changed (``Pool.on_node``): when it publishes KV events, begin loading its models'
        tokenizers now, from its own cards (the pool's, at every node, would be N^2 over a burst of N), so that
        a conversation's first turns are read as token ids too, not routed by content while one loads."""
        cards = state.cards if state.node.kv_events else {}
        for model, card in cards.items():
            root = card.get("root")
            if model not in self._sources and not (isinstance(root, str) and root in self._loads):
                source = _from_cards(model, lambda m: [cards[m]] if m in cards else [])
                if source is not None:
                    self._load(source)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def ids(self, model: str, body: Mapping[str, Any], kind: str) -> Sequence[int] | TokenIds | None:
        """The request's ids (a ``ids.PromptIds``)."""
        outcome, ids = self._ids(model, body, kind)
        self._outcomes.labels(outcome).inc()
        return ids

    def prompt_ids(self, model: str, body: Mapping[str, Any], kind: str) -> list[int] | None:
        """All the request's ids at once."""
        ids = self.ids(model, body, kind)
        return None if ids is None else list(ids if isinstance(ids, Sequence) else ids.whole())

    def _ids(self, model: str, body: Mapping[str, Any], kind: str) -> tuple[str, Sequence[int] | TokenIds | None]:
        given = _given_ids(body, kind)
        if given is not None:
            return ("ids", given) if given else self._refuse(model, "unsupported", "a prompt that is not one prompt")
        loaded, why = self._tokenizer(model)
        if loaded is None:
            return why, None
        try:
            if kind == "completion":
                text = _single_text(body.get("prompt"))
                special = body.get("add_special_tokens", True)
                if text is None or not isinstance(special, bool):
                    return self._refuse(model, "unsupported", "a completions prompt that is not one text")
                return "whole", self._encode(loaded, text, special)
            if kind == "chat":
                return self._chat(model, loaded, body)
            return self._refuse(model, "unsupported", f"requests of kind {kind!r}")
        except Unsupported as exc:
            return self._refuse(model, "unsupported", str(exc))
        except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
            return self._refuse(model, "failed", f"{type(exc).__name__}: {exc}")

    def _chat(self, model: str, loaded: Loaded, body: Mapping[str, Any]) -> tuple[str, Sequence[int] | TokenIds | None]:
        template = loaded.template(body.get("tools"))
        if template is None:
            return self._refuse(model, "failed", "its tokenizer has no chat template")
        text = template.render(body)
        special = body.get("add_special_tokens", False)
        if not isinstance(special, bool):
            raise Unsupported("add_special_tokens must be a boolean")
        splitter = loaded.splitter
        if special or splitter is None or not self._reuse:
            return "whole", self._encode(loaded, text, special)
        ids = ChatIds(splitter, self._cache, text, self._counts)
        if ids.pieces > 1 and loaded.checks_left > 0:
            loaded.checks_left -= 1
            whole = splitter.encode(text)
            if ids.whole() != whole:
                loaded.splitter = None
                self._warn(
                    model,
                    "split",
                    "tokenizing a chat in pieces gave other ids than tokenizing it whole; "
                    "its chats are tokenized whole from now on",
                )
                return "whole", whole
        return ("incremental" if ids.reused else "whole"), ids

    def _encode(self, loaded: Loaded, text: str, special: bool) -> list[int]:
        ids = token_ids(loaded.tokenizer, text, special)
        self._counts[0].inc(len(ids))
        return ids

    def _tokenizer(self, model: str) -> tuple[Loaded | None, str]:
        source, known = self._source(model)
        if source is None:
            if not known:  # no node has told its models yet, or a model no node serves
                return None, "no_tokenizer"
            self._warn(
                model,
                "none",
                "no tokenizer (give --tokenizer MODEL=PATH, or serve it from a local "
                "directory with tokenizer.json); routing by content affinity",
            )
            return None, "no_tokenizer"
        future = self._load(source)
        if future is None:
            return None, "no_tokenizer"
        if not future.done():
            return None, "loading"
        exc = future.exception()
        if exc is not None:
            self._warn(model, "load", f"its tokenizer {source} did not load: {type(exc).__name__}: {exc}")
            self._failed[source] = time.monotonic()
            del self._loads[source]
            return None, "no_tokenizer"
        return future.result(), ""

    def _source(self, model: str) -> tuple[str | None, bool]:
        """The model's tokenizer source, and whether any node gave a card for it."""
        if model in self._sources:
            return self._sources[model], True
        cards = self._cards(model)
        seen = tuple((card.get("root"), card.get("parent")) for card in cards)
        now = time.monotonic()
        known = self._resolved.get(model)
        # Looked up again when the cards change (a node came or learned its models), or now and then.
        if known is not None and known[1] == seen and (known[0] is not None or now - known[2] < RETRY_AFTER):
            return known[0], bool(cards)
        source = _from_cards(model, self._cards)
        if len(self._resolved) >= MAX_MODELS:  # model names come from clients: bound what is remembered
            self._resolved.clear()
        self._resolved[model] = (source, seen, now)
        return source, bool(cards)

    def _load(self, source: str) -> Future[Loaded] | None:
        future = self._loads.get(source)
        if future is None:
            if time.monotonic() - self._failed.get(source, -RETRY_AFTER) < RETRY_AFTER:
                return None
            future = self._loads[source] = self._pool.submit(load, source)
        return future

    def _refuse(self, model: str, outcome: str, why: str) -> tuple[str, None]:
        self._warn(model, outcome, f"{why}: no token ids, routing by content affinity")
        return outcome, None

    def _warn(self, model: str, kind: str, message: str) -> None:
        if (model, kind) not in self._warned and len(self._warned) < MAX_MODELS:
            self._warned.add((model, kind))
            log.warning("prompt tokens model=%s: %s", model, message)


def _from_cards(model: str, cards: Callable[[str], Sequence[ModelCard]], depth: int = 0) -> str | None:
    """A local tokenizer directory from the model's cards: its root, else (a LoRA adapter) its parent's."""
    found = cards(model)
    for card in found:
        root = card.get("root")
        if isinstance(root, str) and root and os.path.isfile(os.path.join(root, "tokenizer.json")):
            return root
    parents = {c.get("parent") for c in found} - {None, model}
    for parent in sorted(p for p in parents if isinstance(p, str)):
        if depth == 0 and (source := _from_cards(parent, cards, depth + 1)) is not None:
            return source
    return None


def _token_ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(type(t) is int and t >= 0 for t in value):
        return value
    return None


def _given_ids(body: Mapping[str, Any], kind: str) -> list[int] | None:
    """Token ids the request gives itself; [] for a prompt that is no single prompt; None for text or a chat."""
    if kind == "generate":
        return _token_ids(body.get("token_ids")) or []
    if kind != "completion":
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return None
    return _token_ids(prompt) or []


def _single_text(prompt: Any) -> str | None:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None
