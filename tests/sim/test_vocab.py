"""``vllm-sim --tokenizer DIR``: the simulated model's tokenizer as a Hugging Face directory, encoding like the
word tokenizer where it matters (generated text round trips, the chat template), and what a node started so
serves."""

from __future__ import annotations

from pathlib import Path

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from tests.support.sim_node import SimNode
from vllm_etcd_proxy.sim import tokens, vocab
from vllm_etcd_proxy.sim.vocab import HfVocab

TOKENIZER = vocab.build()
generated = st.lists(st.integers(tokens.FIRST_GENERATED, tokens.FIRST_PROMPT - 1), max_size=60)
words = st.text(alphabet=st.characters(blacklist_categories=["Z", "C"]), min_size=1, max_size=12)
texts = st.lists(words | st.sampled_from(vocab.WORDS), max_size=20).map(" ".join)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "critic"])
chats = st.lists(st.tuples(roles, texts), min_size=1, max_size=5)


def encode(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False).ids)


@given(generated)
def test_generated_text_tokenizes_back_to_its_ids(ids: list[int]) -> None:
    assert encode(tokens.decode(ids)) == ids


@given(chats, st.booleans())
@settings(max_examples=200)
def test_the_chat_template_renders_what_render_chat_encodes(chat: list[tuple[str, str]], add: bool) -> None:
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(vocab.CHAT_TEMPLATE)
    text = template.render(messages=[{"role": r, "content": c} for r, c in chat], add_generation_prompt=add)
    expected = tokens.render_chat(chat, add_generation_prompt=add, continue_final_message=False, encoder=encode)
    assert encode(text) == expected


def test_words_have_ids_of_their_own_and_other_words_are_spelled() -> None:
    assert len(encode(" ".join(vocab.WORDS))) == len(vocab.WORDS)
    spelled = encode("1f2e3d4c: Hello")
    assert len(spelled) == len("1f2e3d4c:") + len("Hello")
    assert encode("1f2e3d4d: Hello") != spelled
    assert all(t >= tokens.FIRST_PROMPT for t in spelled)


def test_the_benchmarks_words_are_one_token_each() -> None:
    from bench.sessions import _WORDS

    assert len(encode(" ".join(_WORDS))) == len(_WORDS)


def test_the_directory_loads_with_the_tokenizers_library(tmp_path: Path) -> None:
    directory = vocab.write(tmp_path / "tok")
    loaded = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert loaded.encode("<|user|> hello tok17", add_special_tokens=False).ids == encode("<|user|> hello tok17")
    assert HfVocab(directory).encode("the answer tok99") == encode("the answer tok99")


def test_a_node_with_a_tokenizer_continues_exactly_from_text(tmp_path: Path, logs_dir: Path) -> None:
    node = SimNode(logs_dir, tokenizer=tmp_path / "tok", output_len=12).start()
    try:
        (card,) = httpx.get(f"{node.url}/v1/models").json()["data"]
        assert card["root"] == str((tmp_path / "tok").resolve())
        assert httpx.get(f"{node.url}/tokenizer_info").json()["vocab_size"] == TOKENIZER.get_vocab_size()
        body = {"model": "sim-model", "prompt": "Summary: the queue 7x", "max_tokens": 12, "return_token_ids": True}
        whole = httpx.post(f"{node.url}/v1/completions", json=body).json()["choices"][0]
        assert whole["prompt_token_ids"] == encode(body["prompt"])
        head = whole["token_ids"][:5]
        rest = httpx.post(
            f"{node.url}/v1/completions", json={**body, "prompt": body["prompt"] + tokens.decode(head), "max_tokens": 7}
        ).json()["choices"][0]
        assert head + rest["token_ids"] == whole["token_ids"]
    finally:
        node.stop()
