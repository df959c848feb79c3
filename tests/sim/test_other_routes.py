"""vllm-sim as a real process: vLLM's pooling, token-level and Anthropic routes, each recorded and vLLM-shaped."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from tests.support.sim_node import DEV_MODE, SimNode

MODEL = "sim-model"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimNode]:
    with SimNode(tmp_path_factory.mktemp("sim-routes"), env=DEV_MODE, model=[MODEL], ttft=0.01, itl=0.002) as started:
        yield started


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


async def post(client: httpx.AsyncClient, node: SimNode, path: str, rid: str, body: dict[str, Any]) -> Any:
    response = await client.post(f"{node.url}{path}", json={"model": MODEL, **body}, headers={"x-request-id": rid})
    assert response.status_code == 200, response.text
    assert node.wait_for_request(request_id=rid)["path"] == path
    return response.json()


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
async def test_rerank_routes_rank_documents_best_first(node: SimNode, client: httpx.AsyncClient, path: str) -> None:
    body = await post(client, node, path, f"rr{path}", {"query": "q", "documents": ["a", "b", "c"], "top_n": 2})
    assert body["id"].startswith("rerank-") and body["model"] == MODEL
    assert set(body["usage"]) == {"prompt_tokens", "total_tokens"}
    scores = [r["relevance_score"] for r in body["results"]]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    assert {r["document"]["text"] for r in body["results"]} <= {"a", "b", "c"}


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
async def test_score_routes_score_each_pair(node: SimNode, client: httpx.AsyncClient, path: str) -> None:
    body = await post(client, node, path, f"sc{path}", {"text_1": "q", "text_2": ["a", "b"]})
    assert (body["object"], [d["index"] for d in body["data"]]) == ("list", [0, 1])
    assert all(d["object"] == "score" and 0 <= d["score"] < 1 for d in body["data"])


async def test_embeddings_pooling_and_classify_answer_per_input(node: SimNode, client: httpx.AsyncClient) -> None:
    embedded = await post(client, node, "/v1/embeddings", "emb", {"input": ["one", "two"]})
    assert [d["object"] for d in embedded["data"]] == ["embedding", "embedding"]
    assert embedded["data"][0]["embedding"] != embedded["data"][1]["embedding"]
    pooled = await post(client, node, "/pooling", "pool", {"input": "one"})
    assert pooled["data"][0]["data"] == embedded["data"][0]["embedding"]
    classified = await post(client, node, "/classify", "cls", {"input": ["one"]})
    assert classified["data"][0]["object"] == "classification" and classified["data"][0]["num_classes"] == 2
    cohere = await post(client, node, "/v2/embed", "v2e", {"texts": ["one"], "input_type": "search_query"})
    assert cohere["embeddings"]["float"] == [embedded["data"][0]["embedding"]]


async def test_generate_takes_tokens_and_gives_tokens(node: SimNode, client: httpx.AsyncClient) -> None:
    body = await post(
        client,
        node,
        "/inference/v1/generate",
        "gen",
        {"token_ids": [5000, 6000, 7000], "sampling_params": {"max_tokens": 3}},
    )
    [choice] = body["choices"]
    assert body["id"] == "generate-tokens-gen" and choice["finish_reason"] == "length" and len(choice["token_ids"]) == 3
    same = await client.post(
        f"{node.url}/v1/completions", json={"prompt": [5000, 6000, 7000], "max_tokens": 3, "return_token_ids": True}
    )
    assert same.json()["choices"][0]["token_ids"] == choice["token_ids"]
    assert (await client.post(f"{node.url}/inference/v1/generate", json={"token_ids": [1]})).status_code == 400


async def test_tokenizer_info_describes_the_tokenizer(node: SimNode, client: httpx.AsyncClient) -> None:
    info = (await client.get(f"{node.url}/tokenizer_info")).json()
    assert info["tokenizer_class"] and info["model_max_length"] == 4096


async def test_anthropic_messages_answer_in_anthropics_shape(node: SimNode, client: httpx.AsyncClient) -> None:
    body = await post(
        client,
        node,
        "/v1/messages",
        "msg",
        {"max_tokens": 3, "system": "be nice", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert (body["type"], body["role"], body["stop_reason"], body["id"]) == (
        "message",
        "assistant",
        "max_tokens",
        "chatcmpl-msg",
    )
    assert body["usage"]["output_tokens"] == 3 and re.fullmatch(r"( tok\d+){3}", body["content"][0]["text"])


async def test_streamed_anthropic_messages_send_its_events_then_done(node: SimNode, client: httpx.AsyncClient) -> None:
    response = await client.post(
        f"{node.url}/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 2,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    blocks = [b for b in response.text.split("\n\n") if b]
    assert blocks[-1] == "data: [DONE]"
    kinds = [json.loads(b.split("\n")[1].removeprefix("data: "))["type"] for b in blocks[:-1]]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


async def test_anthropic_errors_use_anthropics_envelope(node: SimNode, client: httpx.AsyncClient) -> None:
    response = await client.post(
        f"{node.url}/v1/messages",
        json={
            "model": "nope",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert response.status_code == 404
    assert response.json() == {
        "type": "error",
        "error": {"type": "NotFoundError", "message": "The model `nope` does not exist."},
    }


async def test_a_sleeping_node_holds_pooling_requests_too(node: SimNode, client: httpx.AsyncClient) -> None:
    await client.post(f"{node.url}/sleep")
    try:
        held = asyncio.ensure_future(
            client.post(
                f"{node.url}/v1/rerank", headers={"x-request-id": "held"}, json={"query": "q", "documents": ["a"]}
            )
        )
        await asyncio.to_thread(node.wait_for_request, request_id="held", state="sleeping")
        assert not held.done()
    finally:
        await client.post(f"{node.url}/wake_up")
    assert (await held).status_code == 200
