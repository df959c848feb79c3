"""Chats worked out in pieces (proxy/kvcache/prompt/prefix_ids.py): on the simulator's WordPiece, a byte-level BPE,
Qwen3's own tokenizer and template, and a tokenizer that marks the start of every text, the ids in pieces --
whole or only the first ones, from the cache or not -- are the ids of the rendered chat tokenized whole (what
vLLM computes), while a replica tokenizes only what no earlier prompt began with."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from tests.support.tokenizers import every_kind, qwen3
from vllm_etcd_proxy.proxy.kvcache.index import chain
from vllm_etcd_proxy.proxy.kvcache.prompt import prefix_ids
from vllm_etcd_proxy.proxy.kvcache.prompt.ids import KvPrompt
from vllm_etcd_proxy.proxy.kvcache.prompt.prefix_ids import ChatIds
from vllm_etcd_proxy.proxy.kvcache.prompt.tokens import CHECKED_SPLITS, PromptTokens
from vllm_etcd_proxy.sim import vocab

FRAGMENTS = [
    *vocab.WORDS[:60],
    "Déjà vu",
    "naïve café",
    "e\u0301te\u0301",  # combining accents, as NFC composes them
    "中文的句子",
    "日本語とかな",
    "emoji 🚀🔥",
    "x²+y³",
    "12345678",
    "3.14159",
    "'s",
    "don't",
    "(a, b)",
    "def f(x):\n    return x",
    "\n\n",
    "\t",
    "  ",
    "--",
    "<tool_call>",
    "https://example.com/a?b=c",
]
"""Text that tokenizers split in every way they know: words, accents, scripts without spaces, digits, code,
runs of whitespace, an added token that is not special (Qwen's ``<tool_call>``)."""


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search_the_codebase",
            "description": "Search every file of the repository for a pattern and return the matching lines " * 20,
            "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}},
        },
    }
]
"""A tool whose description is long enough to be cut at its word starts (Qwen3's template renders tools)."""


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        piece = rng.choice(FRAGMENTS)
        out.append(piece)
        size += len(piece) + 1
    return rng.choice(["", " "]).join(out) if rng.random() < 0.1 else " ".join(out)


def conversations(seed: str, count: int, turns: int) -> list[list[dict[str, Any]]]:
    """Conversations sharing a long system preamble (several soft cuts long), each with a long first message of
    its own, then answers and short messages; the last turn of each continues its final message."""
    rng = random.Random(seed)
    preamble = text(rng, 3 * prefix_ids.SOFT_CUT + 500)
    out = []
    for c in range(count):
        messages: list[dict[str, str]] = [
            {"role": "system", "content": preamble},
            {"role": "user", "content": f"conversation {c}: " + text(rng, prefix_ids.SOFT_CUT + 900)},
        ]
        bodies = []
        for turn in range(turns):
            bodies.append({"messages": list(messages), "tools": TOOLS} if c == 1 else {"messages": list(messages)})
            messages += [
                {"role": "assistant", "content": text(rng, 300), "reasoning_content": text(rng, 200)},
                {"role": "user", "content": text(rng, 200 if turn % 2 else 5000)},
            ]
        bodies.append({"messages": messages[:-1], "add_generation_prompt": False, "continue_final_message": True})
        out.append(bodies)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return every_kind(tmp_path_factory.mktemp("tokenizers"))


class Replica:
    """A replica's PromptTokens (or, ``cache=False``, one that tokenizes every chat whole), its tokenizer loaded."""

    def __init__(self, source: Path, cache: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.tokens = PromptTokens({"m": str(source)}, lambda model: [], self.registry, cache_tokens=4_000_000 * cache)
        self.tokens.start()
        self.loaded = self.tokens._loads[str(source)].result(timeout=60)  # loaded in its thread: wait for it

    def ids(self, body: dict[str, Any]) -> ChatIds:
        found = self.tokens.ids("m", body, "chat")
        assert isinstance(found, ChatIds)
        return found

    def whole(self, body: dict[str, Any]) -> list[int]:
        found = self.tokens.prompt_ids("m", body, "chat")
        assert found is not None
        return found

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(
    ("kind", "cuts"),
    [
        ("wordpiece", ("hard", "soft")),
        ("bpe", ("hard", "soft")),
        ("qwen3", ("hard", "soft")),
        ("prepending", ("hard",)),
    ],
)
def test_chats_in_pieces_give_the_ids_of_tokenizing_whole(
    sources: dict[str, Path], kind: str, cuts: tuple[str, ...]
) -> None:
    replica, whole = Replica(sources[kind]), Replica(sources[kind], cache=False)
    assert replica.loaded.splitter is not None and replica.loaded.splitter.kinds == cuts
    first_turns = []
    for c, bodies in enumerate(conversations(kind, count=3, turns=3)):
        for turn, body in enumerate(bodies):
            expected = whole.whole(body)
            before = replica.metric("vllm_proxy_prompt_ids_total", source="tokenized")
            ids = replica.ids(body)
            for count in (1, 100, 3000):  # as far as routing asks, then the rest
                head = ids.head(count)
                assert head == expected[: len(head)] and len(head) >= min(count, len(expected))
            assert ids.whole() == expected, (kind, c, turn)
            if turn == 0:
                first_turns.append(replica.metric("vllm_proxy_prompt_ids_total", source="tokenized") - before)
    # The second and third conversations' first turns reuse the preamble the first one began with: they tokenize
    # their own first message, not the preamble three times as long as it.
    assert replica.metric("vllm_proxy_prompt_tokenize_total", outcome="incremental") == 3 * 4 - 1
    assert max(first_turns[1:]) < first_turns[0] / 2


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_block_keys_kept_with_the_pieces_are_the_keys_of_the_whole_prompt(sources: dict[str, Path], kind: str) -> None:
    # Conversations sharing a preamble, turn by turn, asked for their keys at two block sizes, with and without an
    # adapter and a salt, in an order that has later prompts go on from keys that earlier ones left.
    replica, whole = Replica(sources[kind]), Replica(sources[kind], cache=False)
    tags = [(16, "", ""), (4, "tiny-lora", ""), (16, "", "salt-1"), (16, "tiny-lora", "salt-1")]
    hashed_after_the_first = []
    for c, bodies in enumerate(conversations(f"keys {kind}", count=3, turns=3)):
        for turn, body in enumerate(bodies):
            expected = whole.whole(body)
            for size, lora, salt in tags[c % 2 :] if turn % 2 else tags:
                prompt = KvPrompt(replica.ids(body), "m", salt)
                known = len(replica.ids(body).known_keys((size, lora, salt)))
                got = prompt.keys(size, lora)
                assert got == chain(expected, size, lora, (len(expected) - 1) // size, salt), (kind, c, turn, size)
                if c or turn:
                    hashed_after_the_first.append((known, len(got)))
    # Later prompts hashed only their blocks past the keys an earlier one left (most of them, every turn after the
    # first of the first conversation: the preamble at least).
    assert all(known <= total for known, total in hashed_after_the_first)
    assert sum(known for known, _ in hashed_after_the_first) > 0.5 * sum(total for _, total in hashed_after_the_first)


def test_a_document_at_the_start_of_two_messages_is_read_back_up_to_where_they_part(
    sources: dict[str, Path],
) -> None:
    # Two conversations begin with the same document pasted into their first message, then ask different things
    # in that message: no special token comes between the two, a word start every SOFT_CUT characters does.
    replica = Replica(sources["qwen3"])
    document = text(random.Random("document"), 6 * prefix_ids.SOFT_CUT)
    first = replica.ids({"messages": [{"role": "user", "content": f"{document}\n\nWhat does it say about caches?"}]})
    ids = first.whole()
    second = replica.ids({"messages": [{"role": "user", "content": f"{document}\n\nSummarise it."}]})
    common = next(i for i, (a, b) in enumerate(zip(ids, second.whole(), strict=False)) if a != b)
    assert common * 0.75 < second.reused <= common  # all but the document's last piece (of six)


messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant"]),
            "content": st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=12), max_size=40).map(" ".join),
        }
    ),
    min_size=1,
    max_size=5,
)


@pytest.fixture(scope="module")
def qwen3_replicas() -> tuple[Replica, Replica]:
    return Replica(qwen3()), Replica(qwen3(), cache=False)


@given(chat=messages, generation=st.booleans())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_chat_cut_at_its_word_starts_gives_qwen3s_ids(
    qwen3_replicas: tuple[Replica, Replica], chat: list[dict[str, str]], generation: bool
) -> None:
    replica, whole = qwen3_replicas
    body = {"messages": chat, "add_generation_prompt": generation}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefix_ids, "SOFT_CUT", 24)  # a cut every few words, at every kind of place
        assert replica.ids(body).whole() == whole.whole(body)


def test_a_full_cache_drops_the_ends_of_prompts_before_the_preamble_they_share(sources: dict[str, Path]) -> None:
    source = sources["bpe"]
    preamble = text(random.Random("preamble"), 4 * prefix_ids.SOFT_CUT)
    reference = Replica(source, cache=False)
    shared = len(
        reference.whole({"messages": [{"role": "system", "content": preamble}], "add_generation_prompt": False})
    )
    budget = 3 * shared
    replica = Replica(source)
    replica.tokens._cache = prefix_ids.PrefixIds(budget)  # room for the preamble and about two conversations
    rng = random.Random("conversations")
    for c in range(12):
        body = {
            "messages": [
                {"role": "system", "content": preamble},
                {"role": "user", "content": f"conversation {c}: {text(rng, 4 * prefix_ids.SOFT_CUT)}"},
            ]
        }
        ids = replica.ids(body)
        if c:  # every conversation's own part pushes older ones out, never the preamble they all begin with
            assert ids.reused >= shared
        assert ids.whole() == reference.whole(body)
        assert replica.tokens._cache.tokens <= budget
    # A prompt larger than the whole cache still gives its ids; it cannot keep its own start cached.
    huge = {"messages": [{"role": "user", "content": text(rng, 40 * prefix_ids.SOFT_CUT)}]}
    assert replica.ids(huge).whole() == reference.whole(huge) and replica.tokens._cache.tokens <= budget


def test_a_chat_no_tokenizer_can_read_is_refused_when_read_not_when_routed(sources: dict[str, Path]) -> None:
    # Python's json (the fallback for bodies orjson refuses) lets a lone surrogate through; tokenizers refuse it.
    replica = Replica(sources["wordpiece"])
    for i in range(CHECKED_SPLITS):  # past the first chats, which are also tokenized whole (as a check) at once
        replica.ids({"messages": [{"role": "user", "content": f"chat {i}"}]}).whole()
    body = {"messages": [{"role": "user", "content": "chat 0, then \ud800"}]}
    assert replica.tokens.ids("m", body, "chat") is None
    assert replica.metric("vllm_proxy_prompt_tokenize_total", outcome="failed") == 1
