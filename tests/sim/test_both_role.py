"""vllm-sim as a ``kv_both`` node (either side of the exchange, or whole requests) and its chunked prefill
(``--prefill-chunk``): prompts computed one at a time, and prefill work slowing the decodes beside it."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.procs import wait_until
from tests.support.sim_node import SimNode
from vllm_etcd_proxy.proxy.discovery.loadwatch import read_token_latency

MODEL = "sim-model"
PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
KV_BOTH = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimNode, SimNode]]:
    logs = tmp_path_factory.mktemp("sim-logs")
    # One by its role, one by vLLM's --kv-transfer-config alone; a long ttft shows a decode leg skips it.
    with SimNode(logs, "a", role="both", ttft=1.0) as a, SimNode(logs, "b", kv_transfer_config=KV_BOTH, ttft=1.0) as b:
        yield a, b


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0) as c:
        yield c


async def exchange(client: httpx.AsyncClient, prefill: SimNode, decode: SimNode, request_id: str) -> httpx.Response:
    headers = {"X-Request-Id": request_id}
    prompt = " ".join(f"w{i}" for i in range(40))
    first = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": PREFILL_KV}
    answer = await client.post(f"{prefill.url}/v1/completions", json=first, headers=headers)
    kv = answer.json()["kv_transfer_params"]
    assert kv["remote_engine_id"] == prefill.engine_id
    second = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "kv_transfer_params": kv}
    return await client.post(f"{decode.url}/v1/completions", json=second, headers=headers, timeout=0.9)


async def test_a_both_node_prefills_for_another_and_decodes_from_another(
    pair: tuple[SimNode, SimNode], client: httpx.AsyncClient
) -> None:
    a, b = pair
    assert (a.info()["role"], b.info()["role"]) == ("both", "both")
    one_way = await exchange(client, a, b, "a-to-b")  # within 0.9 s: b pulled the KV, it did not wait its ttft
    assert one_way.headers["x-sim-prefill-engine"] == a.engine_id
    other_way = await exchange(client, b, a, "b-to-a")
    assert other_way.headers["x-sim-prefill-engine"] == b.engine_id
    plain = await client.post(f"{a.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert plain.status_code == 200 and "x-sim-prefill-engine" not in plain.headers


def test_a_role_that_kv_role_cannot_play_is_refused(tmp_path: Path) -> None:
    node = SimNode(tmp_path, role="decode", kv_transfer_config=json.dumps({"kv_role": "kv_producer"}))
    with pytest.raises(RuntimeError, match="does not fit"):
        node.start()


def gauge(metrics: str, name: str) -> float:
    match = re.search(rf'^{re.escape(name)}{{engine="0",model_name="{MODEL}"}} (\S+)$', metrics, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


async def test_prompts_are_computed_one_at_a_time_the_later_ones_waiting(tmp_path: Path) -> None:
    with SimNode(tmp_path, ttft=0.0, prefill_per_token=0.05, prefill_chunk=64) as node:
        async with httpx.AsyncClient(timeout=60.0) as c:
            payload = {"model": MODEL, "prompt": " ".join(f"p{i}" for i in range(200)), "max_tokens": 1}
            calls = [asyncio.create_task(c.post(f"{node.url}/v1/completions", json=payload)) for _ in range(2)]

            def one_computing_one_waiting() -> bool:
                text = node.metrics()
                return (gauge(text, "vllm:num_requests_running"), gauge(text, "vllm:num_requests_waiting")) == (1, 1)

            await asyncio.to_thread(wait_until, one_computing_one_waiting, 5.0, "1 prompt computed, 1 waiting")
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)


async def test_a_prompt_being_computed_slows_the_tokens_of_the_streams_beside_it(tmp_path: Path) -> None:
    # Each token 0.05 s alone; while a 4,000-token prompt is computed (4 s), each gap carries 200 of its tokens
    # (0.2 s) too: all 11 gaps of the stream, or all but the first few if the prompt arrives late. A sleep is
    # never shorter than asked, so the lower bound holds on any machine.
    with SimNode(tmp_path, ttft=0.0, itl=0.05, prefill_per_token=0.001, prefill_chunk=200) as node:
        async with httpx.AsyncClient(timeout=60.0) as c:
            stream = {"model": MODEL, "prompt": "x", "max_tokens": 12, "ignore_eos": True}
            await c.post(f"{node.url}/v1/completions", json=stream)  # the connection open before the timed runs

            async def mean_gap(beside: dict[str, object] | None) -> float:
                before = read_token_latency(node.metrics().encode()) or (0.0, 0.0)
                calls = [c.post(f"{node.url}/v1/completions", json=stream)]
                if beside is not None:
                    calls.append(c.post(f"{node.url}/v1/completions", json=beside))
                assert all(r.status_code == 200 for r in await asyncio.gather(*calls))
                total, count = read_token_latency(node.metrics().encode()) or (0.0, 0.0)
                return (total - before[0]) / (count - before[1])

            long_prompt = {"model": MODEL, "prompt": " ".join(f"p{i}" for i in range(4000)), "max_tokens": 1}
            assert await mean_gap(long_prompt) >= 0.14
            assert await mean_gap(None) < 0.12  # alone: 0.05 s (generous: a busy machine only adds)
