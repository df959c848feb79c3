"""The proxy with static pools (no etcd): the disaggregated flow, mixed routing, errors, cancellation."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 5}


@pytest.fixture(scope="module")
def module_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def fleet(module_logs: Path) -> Iterator[dict[str, SimNode]]:
    nodes = {
        "prefill": SimNode(module_logs, "prefill", role="prefill"),
        "decode": SimNode(module_logs, "decode", role="decode"),
        "mixed": SimNode(module_logs, "mixed", role="mixed", model="other-model"),
    }
    try:
        for node in nodes.values():
            node.start()
        yield nodes
    finally:
        for node in nodes.values():
            node.stop()


@pytest.fixture(scope="module")
def proxy(module_logs: Path, fleet: dict[str, SimNode]) -> Iterator[ProxyProc]:
    replica = ProxyProc(
        module_logs,
        "--prefill",
        fleet["prefill"].host_port,
        "--decode",
        fleet["decode"].host_port,
        "--mixed",
        fleet["mixed"].host_port,
        admin_key="sekret",
    )
    try:
        for role, node in fleet.items():
            replica.wait_routable(role, node.host_port)
        yield replica
    finally:
        replica.stop()


@pytest.fixture(autouse=True)
def _clear(fleet: dict[str, SimNode]) -> None:
    for node in fleet.values():
        node.configure(ttft=0.02, itl=0.005, hang=False, fail_rate=0.0)
        node.clear_requests()


def _legs(fleet: dict[str, SimNode], request_id: str) -> tuple[dict, dict]:  # type: ignore[type-arg]
    prefill = fleet["prefill"].wait_for_request(request_id=request_id)
    decode = fleet["decode"].wait_for_request(request_id=request_id)
    return prefill, decode


@pytest.mark.parametrize("stream", [False, True])
def test_disaggregated_flow_hands_prefill_kv_params_to_decode(
    proxy: ProxyProc, fleet: dict[str, SimNode], stream: bool
) -> None:
    rid = f"disagg-{stream}"
    body = {**CHAT, "stream": stream, "stream_options": {"include_usage": True}} if stream else CHAT
    response = proxy.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid})
    assert response.status_code == 200, response.text
    assert response.headers["x-sim-node"] == fleet["decode"].host_port
    assert response.headers["x-sim-prefill-engine"] == fleet["prefill"].engine_id
    prefill, decode = _legs(fleet, rid)
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert decode["kv_transfer_params"]["do_remote_prefill"] is True
    assert decode["kv_transfer_params"]["remote_engine_id"] == fleet["prefill"].engine_id
    assert decode["max_tokens"] == 5 and decode["stream"] is stream
    if stream:
        assert response.text.rstrip().endswith("data: [DONE]")
        assert '"usage":{"prompt_tokens"' in response.text.replace(" ", "")
    else:
        assert response.json()["usage"]["completion_tokens"] == 5


def test_stream_is_relayed_chunk_by_chunk_not_buffered(proxy: ProxyProc, fleet: dict[str, SimNode]) -> None:
    fleet["decode"].configure(itl=0.3)
    body = {**CHAT, "max_tokens": 20, "stream": True}
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        # The first token arrives while the node is still generating the other 19 (6 s at 0.3 s each).
        decode = fleet["decode"].requests()[-1]
        assert decode["state"] != "finished", decode
        assert first.startswith("data: {")


def test_mixed_model_is_forwarded_byte_for_byte(proxy: ProxyProc, fleet: dict[str, SimNode]) -> None:
    # Odd spacing, key order, escapes and non-ASCII: any re-encoding would change these bytes.
    raw = '{ "prompt":"h\\u00e9 – 你好" ,"model":"other-model",  "max_tokens":2,"vllm_xargs":{"k":1.50}}\n'.encode()
    response = proxy.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json", "x-request-id": "byte-for-byte"}
    )
    assert response.status_code == 200
    assert response.headers["x-sim-node"] == fleet["mixed"].host_port
    seen = fleet["mixed"].wait_for_request(request_id="byte-for-byte")
    assert seen["body_sha256"] == hashlib.sha256(raw).hexdigest()
    assert fleet["prefill"].requests() == []


def test_unknown_model_is_a_404_listing_the_known_ones(proxy: ProxyProc) -> None:
    response = proxy.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "other-model" in error["message"] and MODEL in error["message"]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"model": "", "prompt": "x"}', 400),
        (b'{"model": 5}', 400),
        (b'{"model": "sim-model", "stream": "yes"}', 400),
    ],
)
def test_malformed_requests_get_openai_errors_and_reach_no_node(
    proxy: ProxyProc, fleet: dict[str, SimNode], body: bytes, status: int
) -> None:
    response = proxy.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert fleet["prefill"].requests() == [] and fleet["decode"].requests() == []


def test_client_disconnect_cancels_the_upstream_stream(proxy: ProxyProc, fleet: dict[str, SimNode]) -> None:
    fleet["decode"].configure(itl=0.2)
    body = {**CHAT, "max_tokens": 100, "stream": True}
    with httpx.stream(
        "POST", f"{proxy.url}/v1/chat/completions", json=body, timeout=30, headers={"X-Request-Id": "walks-away"}
    ) as response:
        next(line for line in response.iter_lines() if line.startswith("data:"))
    seen = fleet["decode"].wait_for_request(timeout=2.0, request_id="walks-away", cancelled=True)
    assert seen["completion_tokens"] < 100


def test_client_disconnect_while_waiting_for_a_non_streamed_answer_cancels_it(
    proxy: ProxyProc, fleet: dict[str, SimNode]
) -> None:
    fleet["decode"].configure(itl=0.2)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{proxy.url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 100},
            headers={"X-Request-Id": "impatient"},
            timeout=0.5,
        )
    fleet["decode"].wait_for_request(timeout=2.0, request_id="impatient", cancelled=True)


def test_openai_client_works_streaming_and_not(proxy: ProxyProc) -> None:
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0) as client:
        chat = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=4)  # type: ignore[arg-type]
        assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens == 4
        pieces = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=MODEL,
                messages=CHAT["messages"],
                max_tokens=4,
                stream=True,  # type: ignore[arg-type]
            )
            if c.choices
        ]
        assert "".join(pieces).split() == chat.choices[0].message.content.split()
        completion = client.completions.create(model="other-model", prompt="hi", max_tokens=3)
        assert completion.choices[0].text
        assert [m.id for m in client.models.list()] == sorted([MODEL, "other-model"])


def test_admin_api_needs_the_key_and_edits_the_pool(proxy: ProxyProc, module_logs: Path) -> None:
    body = {"type": "decode", "instance": "127.0.0.1:9"}
    assert proxy.post("/instances/add", json=body).status_code == 401
    assert proxy.post("/instances/add", json=body, headers={"X-Api-Key": "wrong"}).status_code == 401
    added = proxy.post("/instances/add", json=body, headers={"X-Api-Key": "sekret"})
    assert added.json() == {"message": "Waiting for decode_instance 127.0.0.1:9 to start."}
    assert "127.0.0.1:9" in proxy.status()["decode_nodes"]
    auth = {"Authorization": "Bearer sekret"}
    removed = proxy.post("/instances/remove", json=body, headers=auth)
    assert removed.json() == {"message": "Removed 127.0.0.1:9 from decode_instances."}
    again = proxy.post("/instances/remove", json=body, headers=auth)
    assert again.json() == {"message": "Instance 127.0.0.1:9 is not in the decode_instances."}
    bad = proxy.post("/instances/add", json={"type": "gpu", "instance": "x:1"}, headers=auth)
    assert bad.status_code == 400


def test_admin_add_of_a_live_node_makes_it_routable(proxy: ProxyProc, module_logs: Path) -> None:
    with SimNode(module_logs, "late-mixed", role="mixed", model="late-model") as late:
        answer = proxy.post(
            "/instances/add", json={"type": "mixed", "instance": late.host_port}, headers={"X-Api-Key": "sekret"}
        )
        assert answer.json() == {"message": f"Added {late.host_port} to mixed_instances."}
        proxy.wait_routable("mixed", late.host_port)
        response = proxy.post("/v1/completions", json={"model": "late-model", "prompt": "x", "max_tokens": 1})
        assert response.headers["x-sim-node"] == late.host_port
        proxy.post(
            "/instances/remove", json={"type": "mixed", "instance": late.host_port}, headers={"X-Api-Key": "sekret"}
        )


def test_a_stream_that_goes_quiet_ends_with_an_sse_error_after_the_idle_timeout(module_logs: Path) -> None:
    with SimNode(module_logs, "slow-mixed", role="mixed", ttft=0.0, itl=2.0) as slow:
        # No resuming (tests/proxy/test_resume.py has that): the stream ends at the first timeout.
        replica = ProxyProc(
            module_logs,
            "--mixed",
            slow.host_port,
            "--stream-idle-timeout",
            "0.5",
            "--max-resumes",
            "0",
            name="idle-proxy",
        )
        try:
            replica.wait_routable("mixed", slow.host_port)
            body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True}
            answer = replica.post("/v1/completions", json=body)
            assert answer.status_code == 200
            events = [line for line in answer.text.splitlines() if line.startswith("data: ")]
            assert '"upstream_timeout"' in events[-2] and events[-1] == "data: [DONE]"
            assert len(events) == 3  # the first token, the error, [DONE]
        finally:
            replica.stop()
