"""vllm-sim as a real process: request records, model cards with LoRA adapters, sleep mode, scaling, admin routes."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.aio import eventually
from tests.support.sim_node import DEV_MODE, RUNTIME_LORA, SimNode

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimNode]:
    logs = tmp_path_factory.mktemp("sim-admin")
    with SimNode(
        logs,
        env={**RUNTIME_LORA, **DEV_MODE},
        model=[MODEL, "alias"],
        model_root="/models/sim",
        lora=["sql", "chat=/loras/chat"],
        max_model_len=2048,
        ttft=0.01,
        itl=0.002,
    ) as started:
        yield started


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


async def test_a_record_carries_the_routing_fields_headers_and_body_digest(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    body = json.dumps({**CHAT, "request_id": "body-rid", "session_id": "s-1", "cache_salt": "salt", "priority": 3})
    headers = {
        "content-type": "application/json",
        "x-request-id": "hdr-rid",
        "x-data-parallel-rank": "1",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }
    response = await client.post(f"{node.url}/v1/chat/completions?trace=1", content=body, headers=headers)
    assert response.status_code == 200
    record = node.wait_for_request(request_id="hdr-rid")
    assert (record["path"], record["query"], record["method"], record["content_type"]) == (
        "/v1/chat/completions",
        "trace=1",
        "POST",
        "application/json",
    )
    assert (record["body_sha256"], record["body_length"]) == (hashlib.sha256(body.encode()).hexdigest(), len(body))
    assert (record["body_request_id"], record["session_id"], record["cache_salt"], record["priority"]) == (
        "body-rid",
        "s-1",
        "salt",
        3,
    )
    assert (record["data_parallel_rank"], record["traceparent"]) == ("1", headers["traceparent"])


async def test_an_unknown_route_of_any_method_is_recorded_and_answered_404(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    response = await client.request("PUT", f"{node.url}/v9/nothing?a=b", content=b"xyz", headers={"x-request-id": "u1"})
    assert (response.status_code, response.json()) == (404, {"detail": "Not Found"})
    record = node.wait_for_request(request_id="u1")
    seen = (record["method"], record["path"], record["query"], record["body_length"])
    assert seen == ("PUT", "/v9/nothing", "a=b", 3)


async def test_model_cards_give_root_parent_and_max_model_len(node: SimNode, client: httpx.AsyncClient) -> None:
    cards = {card["id"]: card for card in (await client.get(f"{node.url}/v1/models")).json()["data"]}
    assert list(cards) == [MODEL, "alias", "sql", "chat"]
    assert [(c["root"], c["parent"], c["max_model_len"]) for c in cards.values()] == [
        ("/models/sim", None, 2048),
        ("/models/sim", None, 2048),
        ("/adapters/sql", MODEL, None),
        ("/loras/chat", MODEL, None),
    ]
    assert all(c["owned_by"] == "vllm" and c["permission"][0]["object"] == "model_permission" for c in cards.values())
    assert (await client.get(f"{node.url}/v1/models/{MODEL}")).status_code == 404  # vLLM has no GET /v1/models/{id}


async def test_a_request_for_a_lora_adapter_is_answered_in_its_name(node: SimNode, client: httpx.AsyncClient) -> None:
    response = await client.post(f"{node.url}/v1/chat/completions", json={**CHAT, "model": "sql"})
    assert (response.status_code, response.json()["model"]) == (200, "sql")


async def test_loading_and_unloading_an_adapter_changes_the_model_cards(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    load = await client.post(f"{node.url}/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": "/l/new"})
    assert (load.status_code, load.text) == (200, "Success: LoRA adapter 'new' added successfully.")
    ids = [card["id"] for card in (await client.get(f"{node.url}/v1/models")).json()["data"]]
    assert ids[-1] == "new"
    again = await client.post(f"{node.url}/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": "/l/new"})
    assert (again.status_code, again.json()["error"]["type"]) == (400, "InvalidUserInput")
    unload = await client.post(f"{node.url}/v1/unload_lora_adapter", json={"lora_name": "new"})
    assert (unload.status_code, unload.text) == (200, "Success: LoRA adapter 'new' removed successfully.")
    missing = await client.post(f"{node.url}/v1/unload_lora_adapter", json={"lora_name": "new"})
    assert (missing.status_code, missing.json()["error"]["message"]) == (404, "The lora adapter 'new' cannot be found.")
    assert {r["path"] for r in node.requests()} >= {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}


async def test_admin_routes_answer_as_vllms_and_are_recorded(node: SimNode, client: httpx.AsyncClient) -> None:
    for path, answer in (("/reset_prefix_cache", b'{"success":true}'), ("/start_profile", b""), ("/stop_profile", b"")):
        response = await client.post(f"{node.url}{path}", headers={"x-request-id": f"admin{path}"})
        assert (response.status_code, response.content) == (200, answer)
        assert node.wait_for_request(request_id=f"admin{path}")["path"] == path


async def test_a_sleeping_node_holds_generation_until_woken_and_stays_healthy(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    node.sleep(level=1)
    try:
        assert (await client.get(f"{node.url}/is_sleeping")).json() == {"is_sleeping": True}
        assert (await client.get(f"{node.url}/health")).status_code == 200
        assert (await client.get(f"{node.url}/v1/models")).status_code == 200
        held = asyncio.ensure_future(
            client.post(f"{node.url}/v1/chat/completions", json=CHAT, headers={"x-request-id": "asleep"})
        )
        await asyncio.to_thread(node.wait_for_request, request_id="asleep", state="sleeping")
        assert not held.done() and node.snapshot()["waiting"] == 1
    finally:
        node.wake_up()
    assert (await held).status_code == 200
    assert (await client.get(f"{node.url}/is_sleeping")).json() == {"is_sleeping": False}


async def test_scaling_answers_every_request_503_as_vllms_scaling_middleware(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    node.configure(scaling=True)
    try:
        refused = await client.post(f"{node.url}/v1/chat/completions", json=CHAT, headers={"x-request-id": "sc"})
        health = await client.get(f"{node.url}/health")
    finally:
        node.configure(scaling=False)
    assert refused.status_code == 503
    assert refused.json() == {"error": "The model is currently scaling. Please try again later."}
    assert health.status_code == 503
    assert node.wait_for_request(request_id="sc")["status"] == 503
    assert (await client.post(f"{node.url}/v1/chat/completions", json=CHAT)).status_code == 200


def test_lora_flags_read_names_and_paths(tmp_path: Path) -> None:
    from vllm_etcd_proxy.sim.cli import parse_settings

    settings = parse_settings(["--lora", "a", "--lora", "b=/p/b"], {})
    assert settings.loras == (("a", "/adapters/a"), ("b", "/p/b"))
    assert parse_settings([], {"VLLM_SIM_LORA": "x, y=/q"}).loras == (("x", "/adapters/x"), ("y", "/q"))


async def test_a_different_cache_salt_misses_the_prefix_cache(node: SimNode, client: httpx.AsyncClient) -> None:
    words = " ".join(f"salted{i}" for i in range(40))
    chat = {**CHAT, "messages": [{"role": "user", "content": words}]}
    for rid, salt in (("salt-a1", "a"), ("salt-a2", "a"), ("salt-b", "b")):
        response = await client.post(
            f"{node.url}/v1/chat/completions", json={**chat, "cache_salt": salt}, headers={"x-request-id": rid}
        )
        assert response.status_code == 200
    hits = [node.wait_for_request(request_id=rid)["cached_tokens"] for rid in ("salt-a1", "salt-a2", "salt-b")]
    assert hits[0] == 0 and hits[1] >= 32 and hits[2] == 0
    empty = await client.post(f"{node.url}/v1/chat/completions", json={**chat, "cache_salt": ""})
    assert empty.status_code == 400


async def test_ping_and_load_answer_as_vllms_and_are_not_recorded(node: SimNode, client: httpx.AsyncClient) -> None:
    node.clear_requests()
    assert (await client.get(f"{node.url}/ping")).status_code == 200
    assert (await client.post(f"{node.url}/ping")).status_code == 200
    assert (await client.get(f"{node.url}/load")).json() == {"server_load": 0}
    for path in ("/health", "/v1/models", "/is_sleeping", "/metrics", "/version"):
        assert (await client.get(f"{node.url}{path}")).status_code == 200
    assert node.requests() == []


async def test_an_aborting_sleep_ends_running_generations_with_finish_reason_abort(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    node.configure(hang_after_tokens=2)
    try:
        chunks: list[str] = []

        async def stream() -> None:
            async with client.stream(
                "POST",
                f"{node.url}/v1/chat/completions",
                json={**CHAT, "stream": True, "max_tokens": 8},
                headers={"x-request-id": "aborted"},
            ) as response:
                chunks.extend([line async for line in response.aiter_lines() if line.startswith("data: ")])

        running = asyncio.ensure_future(stream())
        await asyncio.to_thread(node.wait_for_request, request_id="aborted", state="hung")
        node.sleep()  # mode=abort, vLLM's default
        await asyncio.wait_for(running, 5.0)
    finally:
        node.wake_up()
        node.configure(hang_after_tokens=0)
    events = [json.loads(c.removeprefix("data: ")) for c in chunks if c != "data: [DONE]"]
    assert chunks[-1] == "data: [DONE]"
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, None, "abort"]
    record = node.wait_for_request(request_id="aborted")
    assert (record["state"], record["completion_tokens"]) == ("aborted", 2)


async def test_a_waiting_sleep_answers_once_running_generations_finished(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    node.configure(hang_after_tokens=2)
    try:
        running = asyncio.ensure_future(
            client.post(
                f"{node.url}/v1/chat/completions", json={**CHAT, "max_tokens": 4}, headers={"x-request-id": "kept"}
            )
        )
        await asyncio.to_thread(node.wait_for_request, request_id="kept", state="hung")
        sleeping = asyncio.ensure_future(client.post(f"{node.url}/sleep", params={"mode": "wait"}))
        await eventually(lambda: is_sleeping(node), 5.0, "the scheduler paused")
        assert not sleeping.done()  # vLLM's sleep with mode=wait completes once the engine has drained
        node.configure(hang_after_tokens=0)
        answer = (await asyncio.wait_for(running, 5.0)).json()
        assert (await asyncio.wait_for(sleeping, 5.0)).json() == {"status": "sleeping", "level": 1}
    finally:
        node.wake_up()
        node.configure(hang_after_tokens=0)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert node.wait_for_request(request_id="kept")["state"] == "done"


def is_sleeping(node: SimNode) -> bool:
    return bool(httpx.get(f"{node.url}/is_sleeping", timeout=5.0).json()["is_sleeping"])


def sleep_state(node: SimNode) -> dict[str, float]:
    """``vllm:engine_sleep_state`` by its ``sleep_state`` label."""
    found = {}
    for line in node.metrics().splitlines():
        if line.startswith("vllm:engine_sleep_state{"):
            state = line.split('sleep_state="', 1)[1].split('"', 1)[0]
            found[state] = float(line.rsplit(" ", 1)[1])
    return found


async def test_a_keeping_sleep_freezes_running_generations_until_the_wake(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    node.configure(itl=0.05)
    try:
        running = asyncio.ensure_future(
            client.post(
                f"{node.url}/v1/completions",
                json={"model": MODEL, "prompt": "keep me", "max_tokens": 40, "ignore_eos": True},
                headers={"x-request-id": "frozen"},
            )
        )
        await asyncio.to_thread(node.wait_for_request, request_id="frozen", state="running")
        assert node.sleep(level=1, mode="keep") == {"status": "sleeping", "level": 1}
        await asyncio.to_thread(node.wait_for_request, request_id="frozen", state="sleeping")
        frozen_at = node.wait_for_request(request_id="frozen")["completion_tokens"]
        assert not running.done() and frozen_at < 40
    finally:
        node.wake_up()
        node.configure(itl=0.002)
    answer = (await asyncio.wait_for(running, 10.0)).json()
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 40


async def test_sleep_levels_tags_and_the_sleep_state_gauge_are_vllms(node: SimNode, client: httpx.AsyncClient) -> None:
    gib = 1 << 30
    assert sleep_state(node) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert node.gpu_memory() == 2 * gib  # 1 GiB of weights and 1 of KV cache by default
    try:
        # Level 0 pauses the scheduler only: no memory moves, no state is 1; "scheduling" wakes it.
        assert node.sleep(level=0) == {"status": "sleeping", "level": 0}
        assert is_sleeping(node) and node.gpu_memory() == 2 * gib
        assert sleep_state(node) == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 0.0}
        assert node.wake_up("scheduling") == {"status": "awake", "tags": ["scheduling"]}
        assert not is_sleeping(node) and sleep_state(node)["awake"] == 1.0
        # Level 1 offloads the weights and drops the KV cache; waking the weights alone is a partial wake.
        node.sleep(level=1)
        assert node.gpu_memory() == 0 and sleep_state(node)["weights_offloaded"] == 1.0
        assert node.wake_up("weights") == {"status": "sleeping", "tags": ["weights"]}
        assert node.gpu_memory() == gib and is_sleeping(node) and sleep_state(node)["awake"] == 0.0
        assert node.wake_up("kv_cache") == {"status": "awake", "tags": ["kv_cache"]}
        assert node.gpu_memory() == 2 * gib and sleep_state(node)["awake"] == 1.0
        node.sleep(level=2)
        assert sleep_state(node) == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
        assert node.wake_up() == {"status": "awake", "tags": None}
        for query, where, kind in (("level=3", "level", "less_than_equal"), ("mode=later", "mode", "literal_error")):
            refused = await client.post(f"{node.url}/sleep?{query}")
            assert refused.status_code == 422
            (problem,) = refused.json()["detail"]
            assert (problem["loc"], problem["type"]) == (["query", where], kind)
        assert not is_sleeping(node)
    finally:
        node.wake_up()


def test_the_sleep_routes_need_vllms_dev_mode(tmp_path: Path) -> None:
    with SimNode(tmp_path, "no-dev") as plain:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
            assert httpx.request(method, f"{plain.url}{path}", timeout=5.0).status_code == 404


def test_two_nodes_time_share_one_gpu_only_while_the_other_sleeps(tmp_path: Path) -> None:
    gpu = {"gpu": tmp_path / "gpu0", "gpu_capacity_gib": 3.0, "wake_time": 0.2}
    with SimNode(tmp_path, "gpu-a", env=DEV_MODE, **gpu) as a:
        with pytest.raises(RuntimeError, match="CUDA out of memory"):
            SimNode(tmp_path, "gpu-b-early", env=DEV_MODE, **gpu).start()
        a.sleep(level=1)
        with SimNode(tmp_path, "gpu-b", env=DEV_MODE, **gpu) as b:
            refused = httpx.post(f"{a.url}/wake_up", timeout=10.0)
            assert refused.status_code == 500 and "CUDA out of memory" in refused.json()["error"]["message"]
            assert is_sleeping(a) and a.gpu_memory() == 0
            b.sleep(level=1)
            assert a.wake_up() == {"status": "awake", "tags": None} and a.gpu_memory() == 2 << 30
            chat = {"model": "sim-model", "prompt": "hi", "max_tokens": 2}
            assert httpx.post(f"{a.url}/v1/completions", json=chat, timeout=10.0).status_code == 200


def test_an_injected_wake_failure_leaves_the_node_asleep(tmp_path: Path) -> None:
    with SimNode(tmp_path, "wake-fail", env=DEV_MODE, wake_fail=503) as failing:
        failing.sleep(level=1)
        assert httpx.post(f"{failing.url}/wake_up", timeout=10.0).status_code == 503
        assert is_sleeping(failing)
        failing.configure(wake_fail=0)
        assert failing.wake_up()["status"] == "awake"
