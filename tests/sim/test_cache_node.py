"""The prefix cache on a real vllm-sim: vLLM's counters, per-request cached_tokens, prefill time, eviction."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.sim_node import SimNode

MODEL = "sim-model"
PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache-logs")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0) as c:
        yield c


def words(tag: str, n: int) -> str:
    """A prompt of ``n`` tokens that no other prompt here shares a block with."""
    return " ".join(f"{tag}{i}" for i in range(n))


def metric(node: SimNode, name: str) -> float:
    match = re.search(rf'^{re.escape(name)}{{engine="0",model_name="{MODEL}"}} (\S+)$', node.metrics(), re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


async def complete(client: httpx.AsyncClient, node: SimNode, rid: str, **body: Any) -> dict[str, Any]:
    """One request; returns the node's record of it."""
    response = await client.post(
        f"{node.url}/v1/completions", json={"model": MODEL, "max_tokens": 1, **body}, headers={"X-Request-Id": rid}
    )
    assert response.status_code == 200, response.text
    return await asyncio.to_thread(node.wait_for_request, request_id=rid, state="done")


async def test_a_repeated_prompt_hits_its_full_blocks_and_vllms_counters_count_tokens(
    logs: Path, client: httpx.AsyncClient
) -> None:
    with SimNode(logs) as node:
        prompt = words("rep", 40)
        assert (await complete(client, node, "r1", prompt=prompt))["cached_tokens"] == 0
        assert (await complete(client, node, "r2", prompt=prompt))["cached_tokens"] == 32
        # 48 tokens: at most 47 may hit, so still 2 blocks; one more token makes the third block hittable.
        assert (await complete(client, node, "r3", prompt=words("rep", 48)))["cached_tokens"] == 32
        assert (await complete(client, node, "r4", prompt=words("rep", 49)))["cached_tokens"] == 48
        counters = node.snapshot()["counters"]
        assert (counters["prefix_cache_queries"], counters["prefix_cache_hits"]) == (40 + 40 + 48 + 49, 112)
        assert metric(node, "vllm:prefix_cache_queries_total") == 177
        assert metric(node, "vllm:prefix_cache_hits_total") == 112


async def test_the_next_chat_turn_hits_the_blocks_the_previous_answer_completed(
    logs: Path, client: httpx.AsyncClient
) -> None:
    with SimNode(logs) as node:
        turn = [{"role": "user", "content": words("chat", 30)}]
        first = (
            await client.post(
                f"{node.url}/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": turn,
                    "return_token_ids": True,
                },
            )
        ).json()
        prompt, answer = first["prompt_token_ids"], first["choices"][0]["token_ids"]
        turn += [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and then"},
        ]
        second = await client.post(
            f"{node.url}/v1/chat/completions",
            json={"model": MODEL, "messages": turn},
            headers={"X-Request-Id": "turn2"},
        )
        assert second.status_code == 200
        computed = len(prompt) + len(answer) - 1  # the last token of an answer never had its KV computed
        assert computed // 16 > (len(prompt) - 1) // 16, "the answer must complete a block for this test"
        seen = await asyncio.to_thread(node.wait_for_request, request_id="turn2", state="done")
        assert seen["cached_tokens"] == computed // 16 * 16


async def test_time_to_first_token_grows_with_the_uncached_prompt(logs: Path, client: httpx.AsyncClient) -> None:
    with SimNode(logs, ttft=0.0, prefill_per_token=0.01) as node:
        prompt = words("slow", 97)
        started = time.monotonic()
        await complete(client, node, "cold", prompt=prompt)
        cold = time.monotonic() - started
        started = time.monotonic()
        assert (await complete(client, node, "warm", prompt=prompt))["cached_tokens"] == 96
        warm = time.monotonic() - started
        assert cold >= 0.97 and warm < 0.7, (cold, warm)
        assert node.info()["prefill_per_token"] == 0.01


async def test_kv_cache_usage_counts_the_blocks_of_running_requests(logs: Path, client: httpx.AsyncClient) -> None:
    with SimNode(logs, cache_blocks=30, ttft=30.0) as node:
        call = asyncio.create_task(
            client.post(
                f"{node.url}/v1/completions",
                json={"model": MODEL, "prompt": words("use", 40), "max_tokens": 1},
                headers={"X-Request-Id": "u1"},
            )
        )
        await asyncio.to_thread(node.wait_for_request, request_id="u1", state="running")
        assert metric(node, "vllm:kv_cache_usage_perc") == pytest.approx(0.1)  # 2 full blocks + 1 partial of 30
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await asyncio.to_thread(node.wait_for_request, request_id="u1", cancelled=True)
        assert metric(node, "vllm:kv_cache_usage_perc") == 0.0
        assert node.snapshot()["kv_cache"] == {
            "block_size": 16,
            "capacity_blocks": 30,
            "used_blocks": 0,
            "cached_blocks": 2,
            "usage": 0.0,
        }


async def test_a_full_cache_evicts_the_least_recently_used_prompt(logs: Path, client: httpx.AsyncClient) -> None:
    with SimNode(logs, cache_blocks=4) as node:
        first, second = words("first", 49), words("second", 49)
        await complete(client, node, "e1", prompt=first)
        assert (await complete(client, node, "e2", prompt=first))["cached_tokens"] == 48
        await complete(client, node, "e3", prompt=second)
        assert (await complete(client, node, "e4", prompt=first))["cached_tokens"] == 0


async def test_zero_cache_blocks_disables_prefix_caching(logs: Path, client: httpx.AsyncClient) -> None:
    with SimNode(logs, cache_blocks=0) as node:
        for rid in ("d1", "d2"):
            assert (await complete(client, node, rid, prompt=words("off", 40)))["cached_tokens"] == 0
        assert metric(node, "vllm:prefix_cache_queries_total") == 0
        assert node.snapshot()["kv_cache"]["capacity_blocks"] == 0


async def test_a_prefill_node_caches_the_prefill_leg(logs: Path, client: httpx.AsyncClient) -> None:
    with SimNode(logs, role="prefill") as node:
        prompt = words("pd", 40)
        for rid, cached in (("p1", 0), ("p2", 32)):
            seen = await complete(client, node, rid, prompt=prompt, kv_transfer_params=PREFILL_KV)
            assert (seen["cached_tokens"], seen["completion_tokens"]) == (cached, 1)
        assert metric(node, "vllm:prefix_cache_hits_total") == 32
