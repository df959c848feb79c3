"""vllm-sim as a real process: vLLM's wire format, disaggregation, queueing, faults, auth, disconnects."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.procs import wait_until
from tests.support.sim_node import SimNode
from vllm_etcd_proxy.proxy.discovery.loadwatch import read_token_latency
from vllm_etcd_proxy.sim.cli import parse_settings
from vllm_etcd_proxy.sim.settings import Role

MODEL = "sim-model"
PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What the proxy sends with a prefill leg (SPEC: disaggregated flow, step 1)."""


@pytest.fixture(scope="module")
def sim_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sim-logs")


@pytest.fixture(scope="module")
def node(sim_logs: Path) -> Iterator[SimNode]:
    with SimNode(sim_logs, model=[MODEL, "alias"], ttft=0.01, itl=0.002) as started:
        yield started


@pytest.fixture(scope="module")
def prefill(sim_logs: Path) -> Iterator[SimNode]:
    with SimNode(sim_logs, role="prefill", ttft=0.01) as started:
        yield started


@pytest.fixture(scope="module")
def decode(sim_logs: Path) -> Iterator[SimNode]:
    # A long ttft shows that a decode leg with remote KV skips (most of) it.
    with SimNode(sim_logs, role="decode", ttft=1.0, itl=0.002) as started:
        yield started


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


def sse(text: str) -> list[Any]:
    """The data payloads of an SSE body, JSON-decoded except the [DONE] terminator."""
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def generated(text: str) -> int:
    """How many generated tokens ``text`` holds; each is one word of the model's vocabulary after a space."""
    assert re.fullmatch(r"( tok\d+)*", text), f"not generated text: {text!r}"
    return text.count(" ")


def gauge(metrics: str, name: str) -> float:
    match = re.search(rf'^{re.escape(name)}{{engine="0",model_name="{MODEL}"}} (\S+)$', metrics, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


# ---- formats ----


async def test_health_models_and_node_header(node: SimNode, client: httpx.AsyncClient) -> None:
    health = await client.get(f"{node.url}/health")
    assert (health.status_code, health.content, health.headers["x-sim-node"]) == (200, b"", node.host_port)
    models = (await client.get(f"{node.url}/v1/models")).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL, "alias"]
    card = models["data"][0]
    assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
    assert (card["object"], card["owned_by"], card["parent"], card["root"]) == ("model", "vllm", None, MODEL)
    assert card["permission"][0]["object"] == "model_permission"


async def test_completion_body_is_vllms(node: SimNode, client: httpx.AsyncClient) -> None:
    response = await client.post(
        f"{node.url}/v1/completions",
        json={"model": "alias", "prompt": "one two three", "max_tokens": 3},
        headers={"X-Request-Id": "req-1"},
    )
    body = response.json()
    assert response.status_code == 200
    assert (body["id"], body["object"], body["model"]) == ("cmpl-req-1", "text_completion", MODEL)
    assert generated(body["choices"][0]["text"]) == 3
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["logprobs"] is None
    assert body["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 6,
        "completion_tokens": 3,
        "prompt_tokens_details": None,
    }
    assert body["kv_transfer_params"] is None and isinstance(body["created"], int)


async def test_chat_body_stops_at_simulated_eos(node: SimNode, client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    body = (await client.post(f"{node.url}/v1/chat/completions", json={"model": MODEL, "messages": messages})).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["tool_calls"] == []
    assert choice["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 16


async def test_completion_stream_one_token_per_chunk_then_usage(node: SimNode, client: httpx.AsyncClient) -> None:
    payload = {
        "model": MODEL,
        "prompt": "a b",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await client.post(f"{node.url}/v1/completions", json=payload)
    assert response.headers["content-type"].startswith("text/event-stream")
    *chunks, usage_chunk, done = sse(response.text)
    assert done == "[DONE]" and len(chunks) == 4
    assert [generated(c["choices"][0]["text"]) for c in chunks] == [1, 1, 1, 1]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
        "prompt_tokens": 2,
        "total_tokens": 6,
        "completion_tokens": 4,
    }


async def test_chat_stream_opens_with_role_and_has_no_usage_unasked(node: SimNode, client: httpx.AsyncClient) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
    *chunks, done = sse((await client.post(f"{node.url}/v1/chat/completions", json=payload)).text)
    assert done == "[DONE]" and len({c["id"] for c in chunks}) == 1
    role, *deltas = [c["choices"][0]["delta"] for c in chunks]
    assert role == {"role": "assistant", "content": ""}
    assert [set(d) for d in deltas] == [{"content"}] * 2 and [generated(d["content"]) for d in deltas] == [1, 1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)


@pytest.mark.parametrize(
    ("body", "status", "error_type", "param"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "NotFoundError", "model"),
        (
            {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "Bad Request",
            "stream_options",
        ),
        ({"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "Bad Request", "max_tokens"),
        ("{not json", 400, "Bad Request", None),
    ],
)
async def test_errors_have_vllms_shape(
    node: SimNode, client: httpx.AsyncClient, body: Any, status: int, error_type: str, param: str | None
) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    response = await client.post(
        f"{node.url}/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    error = response.json()["error"]
    assert response.status_code == status and response.headers["x-sim-node"] == node.host_port
    assert (error["type"], error["param"], error["code"]) == (error_type, param, status)
    if status == 404:
        assert error["message"] == "The model `nope` does not exist."


async def test_openai_client_parses_completions_and_chat(node: SimNode) -> None:
    async with openai.AsyncOpenAI(base_url=f"{node.url}/v1", api_key="unused") as oai:
        completion = await oai.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        text = completion.choices[0].text
        assert generated(text) == 3 and completion.usage is not None
        chat = await oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3
        )
        content = chat.choices[0].message.content
        assert content is not None and generated(content) == 3
        # Deterministic: streamed or not, the same prompt gets the same answer.
        stream = await oai.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == text
        chat_stream = await oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in chat_stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


# ---- disaggregation ----


async def test_prefill_leg_returns_kv_transfer_params(prefill: SimNode, client: httpx.AsyncClient) -> None:
    payload = {"model": MODEL, "prompt": " ".join(["w"] * 40), "max_tokens": 1, "kv_transfer_params": PREFILL_KV}
    body = (await client.post(f"{prefill.url}/v1/completions", json=payload)).json()
    kv = body["kv_transfer_params"]
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "length"
    assert (kv["do_remote_prefill"], kv["do_remote_decode"], kv["tp_size"]) == (True, False, 1)
    assert kv["remote_engine_id"] == prefill.engine_id and kv["remote_host"] == "127.0.0.1"
    assert isinstance(kv["remote_port"], int) and len(kv["remote_block_ids"]) == 3  # 40 tokens / 16 per block


async def test_decode_leg_records_where_kv_came_from(
    prefill: SimNode, decode: SimNode, client: httpx.AsyncClient
) -> None:
    headers = {"X-Request-Id": "disagg-1"}
    first = {"model": MODEL, "prompt": "p q r", "max_tokens": 1, "kv_transfer_params": PREFILL_KV}
    kv = (await client.post(f"{prefill.url}/v1/completions", json=first, headers=headers)).json()["kv_transfer_params"]
    started = time.monotonic()
    second = {"model": MODEL, "prompt": "p q r", "max_tokens": 3, "stream": True, "kv_transfer_params": kv}
    response = await client.post(f"{decode.url}/v1/completions", json=second, headers=headers)
    assert time.monotonic() - started < 0.8, "a decode leg with remote KV must not wait the full ttft"
    assert response.headers["x-sim-node"] == decode.host_port
    assert response.headers["x-sim-prefill-engine"] == prefill.engine_id
    assert len(sse(response.text)) == 4
    seen = decode.wait_for_request(request_id="disagg-1")
    assert seen["kv_transfer_params"] == kv
    assert seen["prefill"] == {"remote_engine_id": prefill.engine_id, "remote_host": "127.0.0.1", "remote_port": 5600}


async def test_decode_node_serves_plain_requests_too(decode: SimNode, client: httpx.AsyncClient) -> None:
    response = await client.post(f"{decode.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert response.status_code == 200 and "x-sim-prefill-engine" not in response.headers


async def test_mixed_node_ignores_kv_transfer_params(node: SimNode, client: httpx.AsyncClient) -> None:
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 2, "kv_transfer_params": PREFILL_KV}
    body = (await client.post(f"{node.url}/v1/completions", json=payload, headers={"X-Request-Id": "mx"})).json()
    assert body["kv_transfer_params"] is None and body["usage"]["completion_tokens"] == 2
    assert node.wait_for_request(request_id="mx")["kv_transfer_params"] == PREFILL_KV


# ---- scheduling, faults, health, auth ----


async def test_batch_slowdown_stretches_each_step_by_the_sequences_running_beside_it(sim_logs: Path) -> None:
    # A first token after 0.3 s: two requests sent together are both running before either's first gap, even
    # when a busy machine delays the second one's arrival.
    with SimNode(sim_logs, ttft=0.3, itl=0.1, batch_slowdown=1.0) as node:
        async with httpx.AsyncClient(timeout=30.0) as c:
            payload = {"model": MODEL, "prompt": "x", "max_tokens": 4, "ignore_eos": True}
            await c.post(f"{node.url}/v1/completions", json=payload)  # connections open before the timed pair

            async def mean_gap(requests: int) -> float:
                before = read_token_latency(node.metrics().encode()) or (0.0, 0.0)
                calls = [c.post(f"{node.url}/v1/completions", json=payload) for _ in range(requests)]
                assert all(r.status_code == 200 for r in await asyncio.gather(*calls))
                total, count = read_token_latency(node.metrics().encode()) or (0.0, 0.0)
                return (total - before[0]) / (count - before[1])

            # Two at once: every gap waits 0.1 s x (1 + 1 x 1); a sleep is never shorter than asked. (A gap of the
            # second request after the first finished waits 0.1 s: the margin below allows one of the six.)
            assert await mean_gap(2) >= 0.175
            assert await mean_gap(1) < 0.15  # alone: 0.1 s (generous: a busy machine only adds)


async def test_max_num_seqs_queues_the_rest(sim_logs: Path) -> None:
    with SimNode(sim_logs, max_num_seqs=1, ttft=30.0) as busy:
        async with httpx.AsyncClient(timeout=30.0) as c:
            payload = {"model": MODEL, "prompt": "x", "max_tokens": 1}
            calls = [asyncio.create_task(c.post(f"{busy.url}/v1/completions", json=payload)) for _ in range(2)]

            def one_running_one_waiting() -> bool:
                text = busy.metrics()
                return (gauge(text, "vllm:num_requests_running"), gauge(text, "vllm:num_requests_waiting")) == (1, 1)

            await asyncio.to_thread(wait_until, one_running_one_waiting, 5.0, "1 running, 1 waiting")
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
        await asyncio.to_thread(wait_until, lambda: busy.snapshot()["running"] == 0, 5.0, "slots freed")
        assert busy.snapshot()["waiting"] == 0


async def test_fail_injection_answers_vllm_errors(sim_logs: Path, client: httpx.AsyncClient) -> None:
    with SimNode(sim_logs, fail_rate=1.0, fail_status=503) as flaky:
        url, payload = f"{flaky.url}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3}
        failed = await client.post(url, json=payload)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == 503
        flaky.configure(fail_rate=0.0, fail_after_tokens=2)
        assert sse((await client.post(url, json={**payload, "stream": True})).text)[-2:] == [
            {
                "error": {
                    "message": "vllm-sim: injected engine failure during generation",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            },
            "[DONE]",
        ]
        flaky.configure(fail_after_tokens=0)
        assert (await client.post(url, json=payload)).status_code == 200


async def test_hang_never_answers_until_released(sim_logs: Path) -> None:
    with SimNode(sim_logs, hang=True) as stuck:
        url, payload = f"{stuck.url}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}
        async with httpx.AsyncClient(timeout=0.3) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await impatient.post(url, json={**payload, "stream": True}, headers={"X-Request-Id": "h1"})
        assert (await asyncio.to_thread(stuck.wait_for_request, request_id="h1", cancelled=True))["status"] == 499
        async with httpx.AsyncClient(timeout=10.0) as patient:
            pending = asyncio.create_task(patient.post(url, json=payload, headers={"X-Request-Id": "h2"}))
            await asyncio.to_thread(stuck.wait_for_request, request_id="h2", state="hung")
            assert gauge(stuck.metrics(), "vllm:num_requests_running") == 1
            stuck.configure(hang=False)
            assert (await pending).status_code == 200


async def test_hang_after_tokens_stalls_a_stream_midway_without_closing_it(sim_logs: Path) -> None:
    with SimNode(sim_logs, itl=0.001) as stalling:
        stalling.configure(hang_after_tokens=3)
        payload = {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True}
        async with httpx.AsyncClient(timeout=10.0) as c:
            async with c.stream(
                "POST", f"{stalling.url}/v1/completions", json=payload, headers={"X-Request-Id": "ha1"}
            ) as r:
                lines = r.aiter_lines()
                received = 0
                while received < 3:
                    received += (await anext(lines)).startswith("data: ")
                seen = await asyncio.to_thread(stalling.wait_for_request, request_id="ha1", state="hung")
                assert seen["completion_tokens"] == 3 and gauge(stalling.metrics(), "vllm:num_requests_running") == 1
                stalling.configure(hang_after_tokens=0)
                rest = [line async for line in lines if line.startswith("data: ")]
            assert len(rest) == 5 + 1 and rest[-1] == "data: [DONE]"
            stalling.configure(hang_after_tokens=1)
            async with c.stream(
                "POST", f"{stalling.url}/v1/completions", json=payload, headers={"X-Request-Id": "ha2"}
            ) as r:
                await asyncio.to_thread(stalling.wait_for_request, request_id="ha2", state="hung")
        left = await asyncio.to_thread(stalling.wait_for_request, request_id="ha2", cancelled=True)
        assert left["completion_tokens"] == 1 and stalling.snapshot()["running"] == 0


async def test_health_follows_unhealthy_file(sim_logs: Path, tmp_path: Path) -> None:
    flag = tmp_path / "unhealthy"
    with SimNode(sim_logs, unhealthy_file=flag) as flippable:
        async with httpx.AsyncClient(timeout=5.0) as c:
            assert (await c.get(f"{flippable.url}/health")).status_code == 200
            flag.touch()
            assert (await c.get(f"{flippable.url}/health")).status_code == 503
            flag.unlink()
            assert (await c.get(f"{flippable.url}/health")).status_code == 200


def test_health_is_503_during_startup_delay(sim_logs: Path) -> None:
    loading = SimNode(sim_logs, startup_delay=1.5).start(wait_healthy=False)
    try:
        assert httpx.get(f"{loading.url}/health").status_code == 503
        wait_until(lambda: httpx.get(f"{loading.url}/health").status_code == 200, 5.0, "healthy after the delay")
    finally:
        loading.stop()


async def test_api_key_guards_v1_only(sim_logs: Path, client: httpx.AsyncClient) -> None:
    with SimNode(sim_logs, api_key="s3cret") as guarded:
        refused = await client.get(f"{guarded.url}/v1/models")
        assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
        assert (await client.get(f"{guarded.url}/health")).status_code == 200
        auth = {"Authorization": "Bearer s3cret", "X-Request-Id": "k1"}
        ok = await client.post(f"{guarded.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=auth)
        assert ok.status_code == 200
        assert guarded.wait_for_request(request_id="k1")["authorization"] == "Bearer s3cret"


# ---- client disconnects ----


async def test_stream_disconnect_cancels_promptly(sim_logs: Path) -> None:
    with SimNode(sim_logs, itl=0.2) as slow:
        payload = {"model": MODEL, "prompt": "x", "max_tokens": 100, "stream": True}
        async with httpx.AsyncClient(timeout=10.0) as c:
            async with c.stream(
                "POST", f"{slow.url}/v1/completions", json=payload, headers={"X-Request-Id": "s1"}
            ) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 2:
                        break
            left = time.monotonic()
        await asyncio.to_thread(slow.wait_for_request, 1.0, request_id="s1", cancelled=True)
        assert time.monotonic() - left < 1.0
        assert slow.snapshot()["running"] == 0


async def test_non_streamed_disconnect_cancels_and_frees_the_slot(sim_logs: Path) -> None:
    with SimNode(sim_logs, ttft=30.0) as slow:
        async with httpx.AsyncClient(timeout=0.3) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await impatient.post(f"{slow.url}/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "n1"})
        await asyncio.to_thread(slow.wait_for_request, 1.0, request_id="n1", cancelled=True)
        assert slow.snapshot()["running"] == 0


# ---- configuration ----


def test_every_flag_reads_its_environment_variable() -> None:
    env = {
        "VLLM_SIM_TTFT": "0.5",
        "VLLM_SIM_MODEL": "a, b",
        "VLLM_SIM_HANG": "true",
        "VLLM_SIM_ROLE": "decode",
        "VLLM_SIM_PREFILL_PER_TOKEN": "0.001",
        "VLLM_SIM_CACHE_BLOCKS": "0",
        "VLLM_SIM_HANG_AFTER_TOKENS": "4",
    }
    settings = parse_settings(["--port", "9000", "--max-num-seqs", "2", "--block-size", "32"], env)
    assert (settings.ttft, settings.models, settings.hang, settings.role) == (0.5, ("a", "b"), True, Role.DECODE)
    assert (settings.port, settings.max_num_seqs, settings.name) == (9000, 2, "127.0.0.1:9000")
    assert (settings.prefill_per_token, settings.cache_blocks, settings.block_size) == (0.001, 0, 32)
    assert settings.hang_after_tokens == 4
    assert parse_settings(["--model", "c"], env).models == ("c",)
    defaults = parse_settings([], {})
    assert (defaults.block_size, defaults.cache_blocks, defaults.prefill_per_token) == (16, 4096, 0.0)


async def test_latency_histograms_are_vllms_and_the_proxy_reads_the_token_latency(
    sim_logs: Path, client: httpx.AsyncClient
) -> None:
    with SimNode(sim_logs, ttft=0.01, itl=0.002) as fresh:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 5}
        response = await client.post(f"{fresh.url}/v1/completions", json=body)
        assert response.status_code == 200
        page = fresh.metrics()
        labels = f'engine="0",model_name="{MODEL}"'
        assert gauge(page, "vllm:time_to_first_token_seconds_count") == 1
        assert gauge(page, "vllm:e2e_request_latency_seconds_count") == 1
        assert gauge(page, "vllm:inter_token_latency_seconds_count") == 4  # the gaps between 5 tokens
        assert f'vllm:inter_token_latency_seconds_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}} 4.0' in page
        assert f"vllm:time_to_first_token_seconds_sum{{{labels}}}" in page
        total, count = read_token_latency(page.encode()) or (0.0, 0.0)
        assert count == 4 and total >= 4 * 0.002
