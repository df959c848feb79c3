"""A stream whose node fails mid-way goes on from another node: the client sees one uninterrupted answer, the
same text a healthy node gives (the simulator's model is deterministic), one [DONE], usage over the whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode
from vllm_etcd_proxy.proxy.serving.resume import Progress, Splice

MODEL = "sim-model"
PROMPT = "tell me a long story about the sea"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def nodes(logs: Path) -> Iterator[list[SimNode]]:
    started = [SimNode(logs, f"resume-{i}", role="mixed", itl=0.005, output_len=40) for i in range(2)]
    try:
        for node in started:
            node.start()
        yield started
    finally:
        for node in started:
            node.stop()


@pytest.fixture(scope="module")
def proxy(logs: Path, nodes: list[SimNode]) -> Iterator[ProxyProc]:
    replica = ProxyProc(
        logs,
        "--mixed",
        *(n.host_port for n in nodes),
        "--policy",
        "round-robin",
        "--eject-after",
        "0",
        "--stream-idle-timeout",
        "1",
    )
    try:
        for node in nodes:
            replica.wait_routable("mixed", node.host_port)
        yield replica
    finally:
        replica.stop()


@pytest.fixture(autouse=True)
def _healthy(nodes: list[SimNode]) -> None:
    for node in nodes:
        node.configure(fail_after_tokens=0, hang_after_tokens=0, hang=False)


def body(path: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 24,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if path == "/v1/chat/completions":
        return {**base, "messages": MESSAGES}
    return {**base, "prompt": PROMPT}


def read_stream(url: str, path: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The answer as a client sees it: text, ids of the events, usage, finish reason, errors, [DONE]s."""
    with httpx.Client(timeout=30) as client:
        response = client.post(url + path, json=payload)
    assert response.status_code == 200, response.text
    seen: dict[str, Any] = {
        "text": "",
        "ids": set(),
        "created": set(),
        "usage": None,
        "finish": None,
        "errors": [],
        "done": 0,
        "roles": 0,
        "token_ids": [],
    }
    for event in response.content.split(b"\n\n"):
        if event == b"data: [DONE]":
            seen["done"] += 1
        elif event.startswith(b"data: "):
            obj = orjson.loads(event[6:])
            if "error" in obj:
                seen["errors"].append(obj["error"])
                continue
            seen["ids"].add(obj["id"])
            seen["created"].add(obj["created"])
            seen["usage"] = obj.get("usage") or seen["usage"]
            for choice in obj["choices"]:
                delta = choice.get("delta") or {}
                seen["roles"] += "role" in delta
                seen["text"] += choice.get("text") or delta.get("content") or ""
                seen["token_ids"] += choice.get("token_ids") or []
                seen["finish"] = choice.get("finish_reason") or seen["finish"]
    return seen


def resumes(proxy: ProxyProc, outcome: str) -> float:
    for line in proxy.get("/metrics").text.splitlines():
        if line.startswith(f'vllm_proxy_resumes_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


def assert_same_answer(resumed: dict[str, Any], healthy: dict[str, Any]) -> None:
    assert resumed["errors"] == []
    assert resumed["text"] == healthy["text"]
    assert resumed["finish"] == healthy["finish"]
    assert resumed["usage"] == healthy["usage"]
    assert resumed["done"] == 1 and len(resumed["ids"]) == 1 and len(resumed["created"]) == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_node_failing_mid_stream_is_resumed_on_another_and_the_client_sees_one_answer(
    proxy: ProxyProc, nodes: list[SimNode], path: str
) -> None:
    healthy = read_stream(nodes[1].url, path, body(path))
    assert healthy["usage"]["completion_tokens"] == 24 and healthy["done"] == 1
    before = resumes(proxy, "resumed")
    nodes[0].configure(fail_after_tokens=7)
    for _ in range(2):  # round-robin: at least one of the two starts on the failing node
        resumed = read_stream(proxy.url, path, body(path))
        assert_same_answer(resumed, healthy)
        if path == "/v1/chat/completions":
            assert resumed["roles"] == 1
    assert before + 1 <= resumes(proxy, "resumed") <= before + 2


def test_token_ids_make_a_completion_continue_exactly(proxy: ProxyProc, nodes: list[SimNode]) -> None:
    path = "/v1/completions"
    healthy = read_stream(nodes[1].url, path, body(path, return_token_ids=True))
    nodes[0].configure(fail_after_tokens=5)
    for _ in range(2):
        resumed = read_stream(proxy.url, path, body(path, return_token_ids=True))
        assert_same_answer(resumed, healthy)
        assert resumed["token_ids"] == healthy["token_ids"] and len(resumed["token_ids"]) == 24
    continued = [r for r in nodes[1].requests() if isinstance(r.get("prompt_tokens"), int)][-2:]
    assert continued  # the node that took over saw the continuation


def test_a_node_that_hangs_mid_stream_is_resumed_after_the_idle_timeout(proxy: ProxyProc, nodes: list[SimNode]) -> None:
    path = "/v1/chat/completions"
    healthy = read_stream(nodes[1].url, path, body(path))
    nodes[0].configure(hang_after_tokens=4)
    for _ in range(2):
        assert_same_answer(read_stream(proxy.url, path, body(path)), healthy)


def test_a_node_killed_mid_stream_is_resumed(logs: Path, nodes: list[SimNode]) -> None:
    victim = SimNode(logs, "resume-victim", role="mixed", itl=0.05, output_len=40).start()
    replica = ProxyProc(
        logs, "--mixed", victim.host_port, nodes[1].host_port, "--policy", "round-robin", name="proxy-kill"
    )
    try:
        replica.wait_routable("mixed", victim.host_port)
        replica.wait_routable("mixed", nodes[1].host_port)
        path = "/v1/completions"
        healthy = read_stream(nodes[1].url, path, body(path))
        client = openai.OpenAI(base_url=f"{replica.url}/v1", api_key="none", max_retries=0)
        streams = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stream=True) for _ in range(2)]
        texts = ["", ""]
        for i, stream in enumerate(streams):
            for n, chunk in enumerate(stream):
                texts[i] += chunk.choices[0].text if chunk.choices else ""
                if n == 3 and i == 0:
                    wait_until(lambda: victim.snapshot()["running"] > 0, 5, "the victim generating")
                    victim.kill()
        assert texts == [healthy["text"], healthy["text"]]
    finally:
        replica.stop()
        victim.stop()


def test_a_request_that_must_not_resume_ends_with_the_error_event(proxy: ProxyProc, nodes: list[SimNode]) -> None:
    path = "/v1/chat/completions"
    nodes[0].configure(fail_after_tokens=3)
    nodes[1].configure(fail_after_tokens=3)
    guided = body(path, guided_json={"type": "object"})
    before = resumes(proxy, "resumed")
    seen = read_stream(proxy.url, path, guided)
    assert len(seen["errors"]) == 1 and seen["done"] == 1
    assert resumes(proxy, "resumed") == before


def test_resumes_stop_at_max_resumes_with_the_error_event(proxy: ProxyProc, nodes: list[SimNode]) -> None:
    path = "/v1/completions"
    for node in nodes:
        node.configure(fail_after_tokens=2)
    before = resumes(proxy, "exhausted")
    seen = read_stream(proxy.url, path, body(path))
    # Two resumes of two tokens each after the first two: six tokens, then the error event and [DONE].
    assert len(seen["errors"]) == 1 and seen["done"] == 1
    assert len(seen["text"].split()) == 6
    assert resumes(proxy, "exhausted") == before + 1


@pytest.mark.parametrize("bad", [b"data: {not json", b'data: {"choices": [}'])
def test_a_continuation_event_that_is_not_json_ends_the_splice_there_and_keeps_what_came_before(bad: bytes) -> None:
    splice = Splice("/v1/chat/completions", Progress(id="chatcmpl-1", created=1, model=MODEL, tokens=3))
    good = b'data: {"id": "x", "choices": [{"index": 0, "delta": {"content": "sea"}}]}\n\n'
    out = splice(good + bad + b"\n\n" + good)
    assert splice.failed is not None and "not a JSON object" in splice.failed.message
    assert out.count(b"data: ") == 1 and b'"id":"chatcmpl-1"' in out  # the event before it, rewritten
