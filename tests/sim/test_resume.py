"""Exact continuation on a real vllm-sim: what a proxy that resumes a broken stream on another node relies on.

An answer is resumed on a second node, after k of its tokens, by token ids (completions: prompt ids + the first k
ids, max_tokens - k), by text (prompt text + the text so far) or as a chat (the partial answer as a final
assistant message with continue_final_message); the second node must produce exactly the remaining tokens.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from tests.support.sim_node import SimNode

MODEL = "sim-model"
PROMPT = "resume me on another node please"
CHAT = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "count to twenty"}]
CUTS = (0, 1, 7, 15, 16)
"""Where the original answer (16 tokens with the default output_len) is cut; 16 resumes after the last token."""
Nodes = tuple[SimNode, SimNode]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    logs = tmp_path_factory.mktemp("resume-logs")
    with SimNode(logs, ttft=0.005, itl=0.001) as first, SimNode(logs, ttft=0.005, itl=0.001) as second:
        yield first, second


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


def events(text: str) -> list[dict[str, Any]]:
    """JSON chunks of an SSE body, [DONE] checked and dropped."""
    payloads = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


async def post(client: httpx.AsyncClient, node: SimNode, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(f"{node.url}{path}", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


# ---- return_token_ids: where vLLM puts the ids ----


async def test_completion_token_ids_sit_on_the_choice(nodes: Nodes, client: httpx.AsyncClient) -> None:
    node = nodes[0]
    body = await post(client, node, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "return_token_ids": True})
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == (await post(client, node, "/tokenize", {"prompt": PROMPT}))["tokens"]
    assert len(choice["token_ids"]) == 5 == body["usage"]["completion_tokens"]
    assert (await post(client, node, "/detokenize", {"tokens": choice["token_ids"]}))["prompt"] == choice["text"]
    plain = (await post(client, node, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5}))["choices"][0]
    assert (plain["text"], plain["token_ids"], plain["prompt_token_ids"]) == (choice["text"], None, None)


async def test_streamed_completion_sends_prompt_ids_once_and_token_ids_on_every_chunk(
    nodes: Nodes, client: httpx.AsyncClient
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    chunks = events((await client.post(f"{nodes[0].url}/v1/completions", json={**body, "return_token_ids": True})).text)
    prompt_ids = (await post(client, nodes[0], "/tokenize", {"prompt": PROMPT}))["tokens"]
    assert [c["choices"][0]["prompt_token_ids"] for c in chunks] == [prompt_ids, None, None, None]
    assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [1, 1, 1, 1]
    plain = events((await client.post(f"{nodes[0].url}/v1/completions", json=body)).text)
    assert all(c["choices"][0]["prompt_token_ids"] is None and c["choices"][0]["token_ids"] is None for c in plain)


async def test_chat_prompt_ids_are_top_level_and_token_ids_on_the_choice(
    nodes: Nodes, client: httpx.AsyncClient
) -> None:
    node = nodes[0]
    rendered = (await post(client, node, "/tokenize", {"messages": CHAT}))["tokens"]
    full = await post(client, node, "/v1/chat/completions", {"messages": CHAT, "return_token_ids": True})
    assert full["prompt_token_ids"] == rendered and full["usage"]["prompt_tokens"] == len(rendered)
    assert len(full["choices"][0]["token_ids"]) == 16 and "prompt_token_ids" not in full["choices"][0]
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True, "return_token_ids": True}
    role, *chunks = events((await client.post(f"{node.url}/v1/chat/completions", json=body)).text)
    assert role["prompt_token_ids"] == rendered and "token_ids" not in role["choices"][0]
    assert all("prompt_token_ids" not in c for c in chunks)
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[t] for t in full["choices"][0]["token_ids"][:3]]
    body["return_token_ids"] = False
    plain = events((await client.post(f"{node.url}/v1/chat/completions", json=body)).text)
    assert plain[0]["prompt_token_ids"] is None and all(c["choices"][0]["token_ids"] is None for c in plain[1:])


# ---- exact continuation ----


@pytest.mark.parametrize("max_tokens", [None, 10])
async def test_completion_resumed_by_token_ids_on_another_node_ends_the_same(
    nodes: Nodes, client: httpx.AsyncClient, max_tokens: int | None
) -> None:
    first, second = nodes
    original = await post(
        client, first, "/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens, "return_token_ids": True}
    )
    choice = original["choices"][0]
    answer, finish = choice["token_ids"], choice["finish_reason"]
    assert (len(answer), finish) == ((16, "stop") if max_tokens is None else (10, "length"))
    for k in (cut for cut in CUTS if cut < len(answer) or finish == "stop"):
        rest = await post(
            client,
            second,
            "/v1/completions",
            {
                "prompt": choice["prompt_token_ids"] + answer[:k],
                "return_token_ids": True,
                "max_tokens": None if max_tokens is None else max_tokens - k,
            },
        )
        assert (rest["choices"][0]["token_ids"], rest["choices"][0]["finish_reason"]) == (answer[k:], finish), k
        assert rest["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"]) + k


async def test_completion_resumed_by_text_ends_the_same(nodes: Nodes, client: httpx.AsyncClient) -> None:
    first, second = nodes
    payload = {"model": MODEL, "prompt": PROMPT, "stream": True, "return_token_ids": True}
    chunks = events((await client.post(f"{first.url}/v1/completions", json=payload)).text)
    texts = [c["choices"][0]["text"] for c in chunks]
    for k in CUTS:
        rest = await post(client, second, "/v1/completions", {"prompt": PROMPT + "".join(texts[:k])})
        assert rest["choices"][0]["text"] == "".join(texts[k:]), k
        assert rest["choices"][0]["finish_reason"] == "stop"


async def test_chat_resumed_with_continue_final_message_ends_the_same(nodes: Nodes, client: httpx.AsyncClient) -> None:
    first, second = nodes
    payload = {"model": MODEL, "messages": CHAT, "stream": True, "return_token_ids": True}
    role, *chunks = events((await client.post(f"{first.url}/v1/chat/completions", json=payload)).text)
    texts = [c["choices"][0]["delta"]["content"] for c in chunks]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert len(ids) == 16 and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    for k in CUTS:
        messages = [*CHAT, {"role": "assistant", "content": "".join(texts[:k])}]
        body = {**payload, "messages": messages, "continue_final_message": True, "add_generation_prompt": False}
        resumed_role, *rest = events((await client.post(f"{second.url}/v1/chat/completions", json=body)).text)
        assert resumed_role["prompt_token_ids"] == role["prompt_token_ids"] + ids[:k]
        assert [t for c in rest for t in c["choices"][0]["token_ids"]] == ids[k:], k
        assert "".join(c["choices"][0]["delta"]["content"] for c in rest) == "".join(texts[k:])
        assert rest[-1]["choices"][0]["finish_reason"] == "stop"


# ---- the chat template's flags, as vLLM checks them ----


async def test_tokenize_renders_chats_like_the_completions_do(nodes: Nodes, client: httpx.AsyncClient) -> None:
    node = nodes[0]
    opened = (await post(client, node, "/tokenize", {"messages": CHAT}))["tokens"]
    closed = await post(
        client, node, "/tokenize", {"messages": CHAT, "add_generation_prompt": False, "return_token_strs": True}
    )
    assert opened == closed["tokens"] + [4] and closed["token_strs"][-1] == " <|end|>"
    assert (await post(client, node, "/detokenize", {"tokens": opened}))["prompt"].endswith(" <|end|> <|assistant|>")
    partial = [*CHAT, {"role": "assistant", "content": " tok20 tok21"}]
    continued = await post(
        client, node, "/tokenize", {"messages": partial, "continue_final_message": True, "add_generation_prompt": False}
    )
    assert continued["tokens"] == opened + [20, 21] and continued["count"] == len(opened) + 2


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_continue_final_message_needs_add_generation_prompt_false(
    nodes: Nodes, client: httpx.AsyncClient, path: str
) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "x"}]
    partial = {"model": MODEL, "messages": messages, "continue_final_message": True}
    both = await client.post(f"{nodes[0].url}{path}", json={**partial, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["message"] == (
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    )
    defaulted = await client.post(f"{nodes[0].url}{path}", json=partial)
    error = defaulted.json()["error"]
    assert (defaulted.status_code, error["type"]) == (400, "BadRequestError")
    assert error["message"].startswith("continue_final_message and add_generation_prompt are not compatible.")


async def test_without_a_generation_prompt_the_answer_takes_the_last_messages_role(
    nodes: Nodes, client: httpx.AsyncClient
) -> None:
    body = {"messages": CHAT, "add_generation_prompt": False, "max_tokens": 2}
    assert (await post(client, nodes[0], "/v1/chat/completions", body))["choices"][0]["message"]["role"] == "user"


async def test_token_ids_outside_the_vocabulary_are_rejected(nodes: Nodes, client: httpx.AsyncClient) -> None:
    for path, body in (("/v1/completions", {"prompt": [1, 40000]}), ("/detokenize", {"tokens": [3, -1]})):
        response = await client.post(f"{nodes[0].url}{path}", json={"model": MODEL, **body})
        assert response.status_code == 400, path
