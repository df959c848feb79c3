"""Requests to token ids (proxy/kvcache/prompt/tokens.py) against a real vllm-sim serving its Hugging Face tokenizer
directory: the ids the proxy computes are the ids the node reports for the same request."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

from tests.support.aio import eventually
from tests.support.procs import HOST, free_port
from tests.support.sim_node import SimNode
from vllm_etcd_proxy.fleet.vllm import ModelCard, parse_model_cards
from vllm_etcd_proxy.proxy.app import build_app
from vllm_etcd_proxy.proxy.flags import build_parser, settings_from_args
from vllm_etcd_proxy.proxy.kvcache.prompt.tokens import Loaded, PromptTokens, load
from vllm_etcd_proxy.sim import protocol, tokens, vocab

MODEL = "sim-model"
SYSTEM = "You answer briefly session 1f2e3d4c: the proxy routes each request"
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hello world"}]},
    {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a cache?"}]},
    {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "tok17 tok18"},
            {"role": "user", "content": "and then?"},
        ],
        "add_generation_prompt": False,
    },
    {
        "messages": [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "tok900 tok33"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {
        "messages": [
            {"role": "critic", "content": "Too long."},
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]},
        ]
    },
]
PROMPTS = ["hello world", "User: hello\nAssistant: tok17 tok18", "  spaced\tout  words 12ab! ", "tok4000 tok5000"]


words = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=10)
contents = st.lists(words | st.sampled_from(vocab.WORDS), max_size=12).map(" ".join)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]), "content": contents}),
    min_size=1,
    max_size=6,
)


@pytest.fixture
def sim(tmp_path: Path, logs_dir: Path) -> Iterator[SimNode]:
    node = SimNode(logs_dir, tokenizer=tmp_path / "sim-tokenizer").start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def sim_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Loaded, vocab.HfVocab]:
    directory = vocab.write(tmp_path_factory.mktemp("sim-tokenizer"))
    return load(str(directory)), vocab.HfVocab(directory)


FLAGS = [{}, {"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True}]


@given(chat=messages, flags=st.sampled_from(FLAGS))
@settings(max_examples=300)
def test_any_chat_renders_to_the_ids_the_simulator_encodes(
    sim_tokenizer: tuple[Loaded, vocab.HfVocab], chat: list[dict[str, str]], flags: dict[str, bool]
) -> None:
    loaded, simulated = sim_tokenizer
    body = {"messages": chat, **flags}
    final = chat[-1]["content"].strip()
    if flags.get("continue_final_message") and (not final or any(final in special for special in tokens.SPECIALS)):
        # transformers cuts after the last place the final message's text appears: with no text there is none,
        # and a text that also appears in a later marker ("|" of "<|end|>") is cut there, by vLLM as by the
        # proxy; the simulator cuts at the message itself.
        return
    text = loaded.templates["default"].render(body)
    ids = loaded.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == protocol.tokenize_ids(body, simulated.encode)


def cards_of(node: SimNode) -> list[ModelCard]:
    return list(parse_model_cards(httpx.get(f"{node.url}/v1/models").json()))


def prompt_tokens(cards: Sequence[ModelCard], sources: dict[str, str] | None = None) -> PromptTokens:
    return PromptTokens(sources or {}, lambda model: [c for c in cards if c["id"] == model], CollectorRegistry())


async def loaded(tokens: PromptTokens, model: str = MODEL) -> PromptTokens:
    await eventually(lambda: tokens.prompt_ids(model, {"prompt": "x"}, "completion") is not None, 10, "a tokenizer")
    return tokens


def outcomes(tokens: PromptTokens, registry_name: str = "vllm_proxy_prompt_tokenize_total") -> dict[str, float]:
    counter = tokens._outcomes  # the registry the counter lives in is the test's own
    return {s.labels["outcome"]: s.value for m in counter.collect() for s in m.samples if s.name == registry_name}


def node_tokenize(node: SimNode, body: dict[str, Any]) -> list[int]:
    response = httpx.post(f"{node.url}/tokenize", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


async def test_the_card_root_names_the_tokenizer_directory(sim: SimNode, tmp_path: Path) -> None:
    (card,) = cards_of(sim)
    assert Path(card["root"]) == (tmp_path / "sim-tokenizer").resolve()
    assert (Path(card["root"]) / "tokenizer.json").is_file()


async def test_completion_text_gives_the_ids_the_node_reports(sim: SimNode) -> None:
    tokens = await loaded(prompt_tokens(cards_of(sim)))
    for prompt in PROMPTS:
        answer = httpx.post(
            f"{sim.url}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "return_token_ids": True},
        ).json()
        reported = answer["choices"][0]["prompt_token_ids"]
        assert tokens.prompt_ids(MODEL, {"prompt": prompt}, "completion") == reported
        assert tokens.prompt_ids(MODEL, {"prompt": [prompt]}, "completion") == reported
        assert answer["usage"]["prompt_tokens"] == len(reported)


async def test_chat_gives_the_ids_the_node_renders(sim: SimNode) -> None:
    tokens = await loaded(prompt_tokens(cards_of(sim)))
    for body in CHATS:
        assert tokens.prompt_ids(MODEL, body, "chat") == node_tokenize(sim, body), body
    streamed = httpx.post(
        f"{sim.url}/v1/chat/completions", json={"model": MODEL, **CHATS[1], "max_tokens": 2, "return_token_ids": True}
    ).json()
    assert tokens.prompt_ids(MODEL, CHATS[1], "chat") == streamed["prompt_token_ids"]


async def test_token_id_prompts_are_taken_as_they_are(sim: SimNode) -> None:
    tokens = prompt_tokens(cards_of(sim))
    assert tokens.prompt_ids(MODEL, {"prompt": [5, 17, 4100]}, "completion") == [5, 17, 4100]
    assert tokens.prompt_ids(MODEL, {"prompt": [[5, 17]]}, "completion") == [5, 17]
    assert tokens.prompt_ids(MODEL, {"token_ids": [9, 8, 7], "sampling_params": {}}, "generate") == [9, 8, 7]
    assert tokens.prompt_ids(MODEL, {"prompt": [[5], [6]]}, "completion") is None  # a batch: several prompts
    assert outcomes(tokens) == {"ids": 3, "unsupported": 1}


async def test_a_six_turn_chat_reuses_earlier_turns_and_matches_tokenizing_whole(sim: SimNode) -> None:
    cards = cards_of(sim)
    tokens = await loaded(prompt_tokens(cards))
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for turn in range(6):
        messages.append({"role": "user", "content": f"turn {turn}: tell me more about the queue"})
        body = {"messages": list(messages)}
        whole = await loaded(prompt_tokens(cards))  # a fresh one: no earlier turns to reuse
        ids = tokens.prompt_ids(MODEL, body, "chat")
        assert ids == whole.prompt_ids(MODEL, body, "chat") == node_tokenize(sim, body)
        answer = httpx.post(f"{sim.url}/v1/chat/completions", json={"model": MODEL, **body, "max_tokens": 8}).json()
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    assert outcomes(tokens)["incremental"] == 5


async def test_a_model_without_a_tokenizer_gives_none_and_one_warning(
    logs_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = SimNode(logs_dir).start()  # the word tokenizer: its card's root is no directory
    try:
        tokens = prompt_tokens(cards_of(node))
        with caplog.at_level(logging.WARNING, "vllm_etcd_proxy.proxy.kvcache.prompt.tokens"):
            for _ in range(3):
                assert tokens.prompt_ids(MODEL, CHATS[0], "chat") is None
                assert tokens.prompt_ids("other-model", {"prompt": "hi"}, "completion") is None
        assert len([r for r in caplog.records if "model=sim-model" in r.getMessage()]) == 1
        assert outcomes(tokens) == {"no_tokenizer": 6}
    finally:
        node.stop()


async def test_the_tokenizer_flag_names_a_directory_the_card_does_not(sim: SimNode, tmp_path: Path) -> None:
    root = cards_of(sim)[0]["root"]
    tokens = await loaded(prompt_tokens([], {"alias": root}), "alias")
    assert tokens.prompt_ids("alias", CHATS[1], "chat") == node_tokenize(sim, CHATS[1])


async def test_bodies_vllm_would_refuse_give_none(sim: SimNode) -> None:
    tokens = await loaded(prompt_tokens(cards_of(sim)))
    refused = [
        {"messages": "hello"},
        {"messages": []},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True, "continue_final_message": True},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 'mine' }}"},
    ]
    assert [tokens.prompt_ids(MODEL, body, "chat") for body in refused] == [None] * len(refused)
    assert tokens.prompt_ids(MODEL, {"prompt": 5}, "completion") is None


def write_tokenizer(directory: Path, tokenizer: Tokenizer, template: str, **config: Any) -> str:
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **config}))
    return str(directory)


def word_tokenizer(vocab: dict[str, int]) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "<eot>")])
    return tokenizer


async def test_text_prompts_get_the_tokenizers_special_tokens_and_chats_only_the_templates(tmp_path: Path) -> None:
    tokenizer = word_tokenizer({"<s>": 0, "<eot>": 1, "<unk>": 2, "hi": 3, "user": 4})
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }}<eot>{% endfor %}"
    source = write_tokenizer(tmp_path / "bos", tokenizer, template, bos_token={"content": "<s>"})
    tokens = await loaded(prompt_tokens([], {"m": source}), "m")
    assert tokens.prompt_ids("m", {"prompt": "hi hi"}, "completion") == [0, 3, 3]
    assert tokens.prompt_ids("m", {"prompt": "hi", "add_special_tokens": False}, "completion") == [3]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert tokens.prompt_ids("m", chat, "chat") == [0, 4, 3, 1]  # the template's bos_token, not the tokenizer's
    assert tokens.prompt_ids("m", {**chat, "add_special_tokens": True}, "chat") == [0, 0, 4, 3, 1]


async def test_a_tokenizer_that_restarts_differently_after_a_cut_is_tokenized_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Metaspace with prepend_scheme "first" marks only a word at the very start of the text: a later turn's
    # tail tokenized alone would start with a marked word ("▁a") where the whole text has "a".
    tokenizer = word_tokenizer({"<s>": 0, "<eot>": 1, "<unk>": 2, "▁a": 3, "a": 4})
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    template = "{% for m in messages %}{{ m['content'] }}<eot>{% endfor %}"
    tokens = await loaded(prompt_tokens([], {"m": write_tokenizer(tmp_path / "meta", tokenizer, template)}), "m")
    messages = [{"role": "user", "content": "a"}]
    with caplog.at_level(logging.WARNING, "vllm_etcd_proxy.proxy.kvcache.prompt.tokens"):
        for turn in range(4):
            ids = tokens.prompt_ids("m", {"messages": messages}, "chat")
            assert ids == [3, 1] + [4, 1] * turn
            messages = [*messages, {"role": "user", "content": "a"}]
    assert "incremental" not in outcomes(tokens)


async def test_a_replica_learns_the_tokenizer_from_its_nodes_model_card(sim: SimNode) -> None:
    app = build_app(settings_from_args(build_parser().parse_args(["--mixed", sim.host_port])))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_config=None, lifespan="on"))
    task = asyncio.create_task(server.serve())
    try:
        await loaded(app.prompt_tokens)
        assert app.prompt_tokens.prompt_ids(MODEL, CHATS[1], "chat") == node_tokenize(sim, CHATS[1])
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"http://{HOST}:{port}/metrics")).text
        assert 'vllm_proxy_prompt_tokenize_total{outcome="whole"}' in metrics
    finally:
        server.should_exit = True
        await task


def test_the_tokenizer_flag_takes_model_equals_source() -> None:
    args = build_parser().parse_args(["--mixed", "127.0.0.1:1", "--tokenizer", "a=/models/a", "--tokenizer", "b=org/b"])
    assert settings_from_args(args).tokenizers == (("a", "/models/a"), ("b", "org/b"))
    with pytest.raises(ValueError, match="MODEL=PATH_OR_HUB_ID"):
        settings_from_args(build_parser().parse_args(["--mixed", "127.0.0.1:1", "--tokenizer", "no-source"]))


async def test_a_template_that_loops_over_content_gets_text_parts(tmp_path: Path) -> None:
    # vLLM's "openai" content format: the template sees [{"type": "text", "text": ...}], not a joined string.
    tokenizer = word_tokenizer({"<s>": 0, "<eot>": 1, "<unk>": 2, "hi": 3, "there": 4, "[t]": 5})
    template = (
        "{% for message in messages %}{% if message['role'] != 'user' %}{{ raise_exception('users only') }}"
        "{% endif %}{% for part in message['content'] %}[t] {{ part['text'] }} {% endfor %}<eot>"
        "{% endfor %}"
    )
    tokens = await loaded(prompt_tokens([], {"m": write_tokenizer(tmp_path / "parts", tokenizer, template)}), "m")
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, "there"]}]}
    assert tokens.prompt_ids("m", parts, "chat") == [5, 3, 5, 4, 1]
    assert tokens.prompt_ids("m", {"messages": [{"role": "user", "content": "hi"}]}, "chat") == [5, 3, 1]
    assert tokens.prompt_ids("m", {"messages": [{"role": "system", "content": "hi"}]}, "chat") is None
    assert outcomes(tokens)["failed"] == 1


async def test_a_bad_cut_the_samples_miss_is_caught_on_the_first_chats(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The same Metaspace tokenizer, but every id the load-time samples draw from the vocabulary is a special
    # token and the sample chat's words are unknown to it: only real requests show the difference.
    vocab_ = {f"<x{i}>" if i % 2 == 0 else f"w{i}": i for i in range(99)} | {"a": 99, "<unk>": 100, "▁a": 101}
    tokenizer = Tokenizer(models.WordLevel(vocab_, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vocab_ if t[0] == "<"])
    template = "{% for m in messages %}{{ m['content'] }}<x0>{% endfor %}"
    tokens = await loaded(prompt_tokens([], {"m": write_tokenizer(tmp_path / "meta", tokenizer, template)}), "m")
    messages = [{"role": "user", "content": "a"}]
    with caplog.at_level(logging.WARNING, "vllm_etcd_proxy.proxy.kvcache.prompt.tokens"):
        for turn in range(4):
            assert tokens.prompt_ids("m", {"messages": messages}, "chat") == [101, 0] + [99, 0] * turn
            messages = [*messages, {"role": "user", "content": "a"}]
    assert "incremental" not in outcomes(tokens)
    assert sum("tokenized whole from now on" in r.getMessage() for r in caplog.records) == 1
