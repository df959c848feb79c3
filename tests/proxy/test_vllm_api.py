"""vLLM's API beyond chat and completions, through two replicas in front of two nodes: audio uploads, the Responses
API's state, model cards, every other route, node-admin routes, node states, Anthropic's error envelope."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import DEV_MODE, SimNode

MODEL = "sim-model"
ADAPTER = "sim-lora"


@pytest.fixture(scope="module")
def module_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def nodes(module_logs: Path) -> Iterator[list[SimNode]]:
    started = [
        SimNode(module_logs, f"node-{i}", env=DEV_MODE, role="mixed", lora=ADAPTER, max_model_len=8192 - 1024 * i)
        for i in range(2)
    ]
    try:
        for node in started:
            node.start()
        yield started
    finally:
        for node in started:
            node.stop()


@pytest.fixture(scope="module")
def replicas(module_logs: Path, nodes: list[SimNode]) -> Iterator[list[ProxyProc]]:
    flags = [arg for node in nodes for arg in ("--mixed", node.host_port)]
    started: list[ProxyProc] = []
    try:
        for i in range(2):
            started.append(ProxyProc(module_logs, *flags, "--scrape-load", "0.2", name=f"replica-{i}"))
        for replica in started:
            for node in nodes:
                replica.wait_routable("mixed", node.host_port)
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture(autouse=True)
def _clear(nodes: list[SimNode]) -> None:
    for node in nodes:
        node.configure(ttft=0.01, itl=0.002, scaling=False)  # scaling first: a scaling node refuses /wake_up too
        node.wake_up()
        node.clear_requests()


def owner(nodes: list[SimNode], response: httpx.Response) -> SimNode:
    return next(n for n in nodes if n.host_port == response.headers["x-sim-node"])


def all_requests(nodes: list[SimNode]) -> list[dict[str, Any]]:
    return [r for node in nodes for r in node.requests()]


# ---- audio: multipart uploads ----

AUDIO = bytes(range(256)) * 400  # 100 KiB of "audio", every byte value


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/audio/transcriptions", "/v1/audio/translations"])
def test_a_multipart_audio_upload_reaches_a_node_byte_for_byte(
    replicas: list[ProxyProc], nodes: list[SimNode], route: str, stream: bool
) -> None:
    for replica in replicas:
        files = {"file": ("clip.wav", AUDIO, "audio/wav")}
        data = {"response_format": "json", "stream": "true" if stream else "false", "model": MODEL}
        upload = httpx.Request("POST", replica.url + route, files=files, data=data)
        raw = upload.read()
        answer = httpx.post(
            replica.url + route, content=raw, headers={"content-type": upload.headers["content-type"]}, timeout=30
        )
        assert answer.status_code == 200, answer.text
        if stream:
            assert answer.headers["content-type"].startswith("text/event-stream")
            assert answer.text.rstrip().endswith("data: [DONE]")
        else:
            assert answer.json()["text"]
        seen = owner(nodes, answer).requests()[-1]
        assert seen["path"] == route and seen["body_length"] == len(raw)
        assert seen["body_sha256"] == hashlib.sha256(raw).hexdigest()


def test_an_upload_for_a_model_no_node_serves_is_a_404_naming_the_known_ones(replicas: list[ProxyProc]) -> None:
    answer = httpx.post(
        replicas[0].url + "/v1/audio/transcriptions",
        files={"file": ("a.wav", b"RIFF")},
        data={"model": "whisper-nope"},
        timeout=10,
    )
    assert answer.status_code == 404 and MODEL in answer.json()["error"]["message"]


# ---- Responses API: state on the node that made each response ----


def test_a_ten_turn_previous_response_id_chain_alternating_replicas_succeeds_every_turn(
    replicas: list[ProxyProc], nodes: list[SimNode]
) -> None:
    previous: str | None = None
    holders = set()
    for turn in range(10):
        body: dict[str, Any] = {"model": MODEL, "input": f"turn {turn}: tell me more", "max_output_tokens": 8}
        if previous is not None:
            body["previous_response_id"] = previous
        answer = replicas[turn % 2].post("/v1/responses", json=body)
        assert answer.status_code == 200, (turn, answer.text)
        assert answer.json()["status"] in ("completed", "incomplete")  # incomplete: max_output_tokens reached
        previous = answer.json()["id"]
        holders.add(answer.headers["x-sim-node"])
    assert len(holders) == 1  # the conversation stayed where its state and prefix cache are
    seen = [r for r in all_requests(nodes) if r["path"] == "/v1/responses"]
    assert len(seen) == 10 and all(r["status"] == 200 for r in seen)


def test_get_cancel_and_delete_by_id_work_from_either_replica(replicas: list[ProxyProc]) -> None:
    made = replicas[0].post("/v1/responses", json={"model": MODEL, "input": "hello", "max_output_tokens": 4})
    response_id = made.json()["id"]
    for replica in replicas:
        got = replica.get(f"/v1/responses/{response_id}")
        assert got.status_code == 200 and got.json()["id"] == response_id
        assert got.headers["x-sim-node"] == made.headers["x-sim-node"]
    replayed = httpx.get(f"{replicas[1].url}/v1/responses/{response_id}?stream=true&starting_after=1", timeout=10)
    assert replayed.status_code == 200 and "response.completed" in replayed.text
    assert '"sequence_number":0,' not in replayed.text.replace(" ", "")  # events after the first two only
    deleted = httpx.delete(f"{replicas[1].url}/v1/responses/{response_id}", timeout=10)
    assert deleted.status_code == 200
    assert replicas[0].get(f"/v1/responses/{response_id}").status_code == 404


def test_background_responses_are_polled_and_cancelled_through_any_replica(
    replicas: list[ProxyProc], nodes: list[SimNode]
) -> None:
    body = {"model": MODEL, "input": "write a poem", "background": True, "max_output_tokens": 6}
    queued = replicas[0].post("/v1/responses", json=body)
    assert queued.status_code == 200 and queued.json()["status"] in ("queued", "in_progress")
    response_id = queued.json()["id"]

    def completed() -> bool:
        return replicas[1].get(f"/v1/responses/{response_id}").json()["status"] in ("completed", "incomplete")

    wait_until(completed, 20, "the background response to complete, polled through the other replica")
    for node in nodes:
        node.configure(itl=1.0)
    slow = replicas[1].post("/v1/responses", json={**body, "max_output_tokens": 50}).json()["id"]
    cancelled = replicas[0].post(f"/v1/responses/{slow}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"


def test_a_response_whose_node_left_the_fleet_is_a_404_that_says_so(module_logs: Path) -> None:
    with SimNode(module_logs, "short-lived") as node:
        replica = ProxyProc(module_logs, "--mixed", node.host_port, admin_key="adm", name="leaving")
        try:
            replica.wait_routable("mixed", node.host_port)
            made = replica.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2})
            response_id = made.json()["id"]
            removed = replica.post(
                "/instances/remove", json={"type": "mixed", "instance": node.host_port}, headers={"X-Api-Key": "adm"}
            )
            assert removed.status_code == 200
            for answer in (
                replica.get(f"/v1/responses/{response_id}"),
                replica.post(
                    "/v1/responses", json={"model": MODEL, "input": "again", "previous_response_id": response_id}
                ),
            ):
                assert answer.status_code == 404
                assert "left the fleet" in answer.json()["error"]["message"]
        finally:
            replica.stop()


def test_a_response_id_the_proxy_did_not_make_is_a_404_saying_why(replicas: list[ProxyProc]) -> None:
    answer = replicas[0].get("/v1/responses/resp_0123456789abcdef0123456789abcdef")
    assert answer.status_code == 404 and "not made through this proxy" in answer.json()["error"]["message"]


# ---- model cards ----


def test_model_cards_keep_the_nodes_fields(replicas: list[ProxyProc]) -> None:
    for replica in replicas:
        cards = {card["id"]: card for card in replica.get("/v1/models").json()["data"]}
        assert cards[MODEL]["root"] and cards[MODEL]["parent"] is None
        assert cards[ADAPTER]["parent"] == MODEL  # a client tells the adapter from its base
        assert cards[MODEL]["max_model_len"] == 7168  # the smaller of the two nodes': a prompt fits either
        assert isinstance(cards[MODEL]["permission"], list)
        one = replica.get(f"/v1/models/{ADAPTER}")
        assert one.status_code == 200 and one.json()["parent"] == MODEL
        assert replica.get("/v1/models/nope").status_code == 404


# ---- every other route vLLM serves ----

ROUTES = [
    ("POST", "/rerank", {"model": MODEL, "query": "q", "documents": ["a", "b"]}),
    ("POST", "/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a", "b"]}),
    ("POST", "/v2/rerank", {"model": MODEL, "query": "q", "documents": ["a", "b"]}),
    ("POST", "/score", {"model": MODEL, "text_1": "a", "text_2": "b"}),
    ("POST", "/v1/embeddings", {"model": MODEL, "input": "hello"}),
    ("POST", "/pooling", {"model": MODEL, "input": "hello"}),
    ("POST", "/classify", {"model": MODEL, "input": "hello"}),
    ("POST", "/inference/v1/generate", {"model": MODEL, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3}}),
    ("POST", "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/version", None),
    ("GET", "/tokenizer_info", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_every_other_vllm_route_is_forwarded_to_a_node(
    replicas: list[ProxyProc], nodes: list[SimNode], method: str, path: str, body: dict[str, Any] | None
) -> None:
    raw = json.dumps(body).encode() if body is not None else b""
    headers = {"content-type": "application/json"} if body is not None else {}
    answer = httpx.request(method, replicas[1].url + path, content=raw, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    assert "x-sim-node" in answer.headers
    if body is not None:
        seen = owner(nodes, answer).requests()[-1]
        assert seen["path"] == path and seen["body_sha256"] == hashlib.sha256(raw).hexdigest()


def test_a_request_that_names_no_model_goes_to_the_fleets_first_model(replicas: list[ProxyProc]) -> None:
    answer = replicas[0].post("/v1/embeddings", json={"input": "hello"})
    assert answer.status_code == 200 and "x-sim-node" in answer.headers


def test_the_model_may_come_from_the_query_string(replicas: list[ProxyProc]) -> None:
    assert replicas[0].get(f"/tokenizer_info?model={MODEL}").status_code == 200
    assert replicas[0].get("/tokenizer_info?model=nope").status_code == 404


def test_routing_fields_and_headers_pass_unchanged(replicas: list[ProxyProc], nodes: list[SimNode]) -> None:
    body = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 2,
        "priority": 3,
        "session_id": "s-1",
        "cache_salt": "tenant-a",
    }
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    answer = replicas[0].post(
        "/v1/completions", json=body, headers={"X-data-parallel-rank": "1", "traceparent": traceparent}
    )
    assert answer.status_code == 200
    seen = owner(nodes, answer).requests()[-1]
    assert (seen["priority"], seen["session_id"], seen["cache_salt"]) == (3, "s-1", "tenant-a")
    assert (seen["data_parallel_rank"], seen["traceparent"]) == ("1", traceparent)


# ---- node-admin routes ----


@pytest.mark.parametrize(
    "path",
    [
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/sleep",
        "/wake_up",
        "/reset_prefix_cache",
        "/start_profile",
        "/stop_profile",
        "/is_sleeping",
    ],
)
def test_node_admin_routes_are_refused_and_reach_no_node(
    replicas: list[ProxyProc], nodes: list[SimNode], path: str
) -> None:
    method = "GET" if path == "/is_sleeping" else "POST"
    answer = httpx.request(method, replicas[0].url + path, json={"lora_name": "x", "lora_path": "/x"}, timeout=10)
    assert answer.status_code == 403
    assert answer.json()["error"]["code"] == "node_admin_route" and "node-admin" in answer.json()["error"]["message"]
    assert all_requests(nodes) == []


# ---- node states ----


def test_a_sleeping_node_gets_nothing_until_it_wakes(replicas: list[ProxyProc], nodes: list[SimNode]) -> None:
    asleep, awake = nodes
    asleep.sleep(level=1)

    def seen_asleep(replica: ProxyProc) -> bool:
        return any(w["id"] == asleep.host_port and w["asleep"] for w in replica.workers())

    for replica in replicas:
        wait_until(lambda r=replica: seen_asleep(r), 10, "the replica to see the node asleep")
    asleep.clear_requests()
    for i in range(8):
        answer = replicas[i % 2].post("/v1/completions", json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 2})
        assert answer.status_code == 200 and answer.headers["x-sim-node"] == awake.host_port
    assert asleep.requests() == []
    asleep.wake_up()
    for replica in replicas:
        wait_until(lambda r=replica: not seen_asleep(r), 10, "the replica to see the node awake")


def test_a_node_answering_503_while_scaling_loses_no_request(replicas: list[ProxyProc], nodes: list[SimNode]) -> None:
    scaling, steady = nodes
    scaling.configure(scaling=True)
    started = time.monotonic()
    for i in range(8):
        answer = replicas[i % 2].post("/v1/completions", json={"model": MODEL, "prompt": f"q{i}", "max_tokens": 2})
        assert answer.status_code == 200 and answer.headers["x-sim-node"] == steady.host_port
    assert time.monotonic() - started < 20
    refused = [r for r in scaling.requests() if r["path"] == "/v1/completions"]
    assert len(refused) <= 2  # one per replica, then the node is held back for a while


# ---- Anthropic's error envelope ----


def test_errors_the_proxy_makes_on_v1_messages_use_anthropics_envelope(replicas: list[ProxyProc]) -> None:
    answer = replicas[0].post(
        "/v1/messages", json={"model": "claude-nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert answer.status_code == 404
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    bad = replicas[0].post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
