"""vllm-sim as a real process: request records, model cards with LoRA adapters, sleep mode, scaling, admin routes."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.sim_node import RUNTIME_LORA, SimNode

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimNode]:
    logs = tmp_path_factory.mktemp("sim-admin")
    with SimNode(
        logs,
        env=RUNTIME_LORA,
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


async def test_admin_routes_answer_200_and_are_recorded(node: SimNode, client: httpx.AsyncClient) -> None:
    for path in ("/reset_prefix_cache", "/start_profile", "/stop_profile"):
        response = await client.post(f"{node.url}{path}", headers={"x-request-id": f"admin{path}"})
        assert (response.status_code, response.content) == (200, b"")
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


async def test_a_waiting_sleep_lets_running_generations_finish(node: SimNode, client: httpx.AsyncClient) -> None:
    node.configure(hang_after_tokens=2)
    try:
        running = asyncio.ensure_future(
            client.post(
                f"{node.url}/v1/chat/completions", json={**CHAT, "max_tokens": 4}, headers={"x-request-id": "kept"}
            )
        )
        await asyncio.to_thread(node.wait_for_request, request_id="kept", state="hung")
        assert (await client.post(f"{node.url}/sleep", params={"mode": "wait"})).status_code == 200
        node.configure(hang_after_tokens=0)
        answer = (await asyncio.wait_for(running, 5.0)).json()
    finally:
        node.wake_up()
        node.configure(hang_after_tokens=0)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert node.wait_for_request(request_id="kept")["state"] == "done"
