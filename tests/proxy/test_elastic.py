"""Nodes that prefill and decode (role ``both``), their part picked per request, on real processes: three both
nodes under registrars, two replicas. A long new prompt is split (prefill on one node, decode on another, never
the same), a short one or one whose start a node holds runs on one node; the replicas agree on the split of a
request they both see; a both node that dies mid-decode is resumed like any other."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import HOST, wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode
from tests.support.stack import LocalStack, StackProxy

MODEL = "sim-model"
LONG = 600
"""Words of a prompt that is split: far over --split-min-prompt-tokens (256) by any count of its tokens."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    work = tmp_path_factory.mktemp("elastic")
    fleet = LocalStack(
        work / "run",
        work / "logs",
        prefill=0,
        decode=0,
        both=3,
        sim_flags=("--ttft", "0.05", "--itl", "0.005", "--prefill-per-token", "0.0001"),
        proxy_flags=("--scrape-load", "0.1"),
    )
    with fleet:
        yield fleet


def prompt(tag: str, words: int = LONG) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


def records(stack: LocalStack) -> list[dict[str, Any]]:
    """Every request the nodes recorded, each with the node that served it."""
    found = []
    for node in stack.nodes:
        answer = httpx.get(f"{node.url}/sim/requests", timeout=5).json()
        found += [{**r, "node": node.node_id} for r in answer["requests"]]
    return found


def legs(stack: LocalStack, request_id: str) -> dict[str, list[str]]:
    """The nodes that took each kind of leg of a request: prefill (kept its KV for another), decode (pulled KV
    from another), whole (neither)."""
    found: dict[str, list[str]] = {"prefill": [], "decode": [], "whole": []}
    for r in records(stack):
        if r["request_id"] != request_id:
            continue
        kv = r.get("kv_transfer_params") or {}
        kind = "prefill" if kv.get("do_remote_decode") else "decode" if r.get("prefill") else "whole"
        found[kind].append(r["node"])
    return found


def complete(proxy: StackProxy, text: str, request_id: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": text, "max_tokens": 8, **extra}
    answer = httpx.post(f"{proxy.url}/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


def metric(proxy: StackProxy, name: str, **labels: str) -> float:
    text = httpx.get(f"{proxy.url}/metrics", timeout=5).text
    total = 0.0
    for found, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', found))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def idle(stack: LocalStack) -> bool:
    """Every replica's last scrape of every node shows nothing running or waiting."""
    for proxy in stack.proxies:
        for worker in proxy.workers():
            load = worker.get("node_load") or {}
            if worker["in_flight"] or load.get("running") or load.get("waiting"):
                return False
    return True


def test_both_nodes_are_listed_with_their_role(stack: LocalStack) -> None:
    for proxy in stack.proxies:
        status = proxy.status()
        assert status["both_node_count"] == 3
        assert status["both_nodes"] == sorted(n.node_id for n in stack.nodes)
        assert {w["role"] for w in proxy.workers()} == {"both"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_new_prompt_is_split_and_a_short_one_runs_on_one_node(stack: LocalStack, stream: bool) -> None:
    for i, proxy in enumerate(stack.proxies):
        split = complete(proxy, prompt(f"s{stream}{i}x"), f"split-{stream}-{i}", stream=stream)
        taken = legs(stack, f"split-{stream}-{i}")
        assert len(taken["prefill"]) == len(taken["decode"]) == 1 and not taken["whole"], taken
        assert taken["prefill"] != taken["decode"]
        assert split.headers["x-sim-node"] == taken["decode"][0]
        assert split.headers["x-sim-prefill-engine"]  # the decode node pulled the prompt's KV

        short = complete(proxy, "a short question", f"short-{stream}-{i}", stream=stream)
        taken = legs(stack, f"short-{stream}-{i}")
        assert taken == {"prefill": [], "decode": [], "whole": [short.headers["x-sim-node"]]}
        assert "x-sim-prefill-engine" not in short.headers
    for proxy in stack.proxies:
        assert metric(proxy, "vllm_proxy_elastic_requests_total", decision="split") >= 1
        assert metric(proxy, "vllm_proxy_elastic_requests_total", decision="local", reason="few_new") >= 1
        assert metric(proxy, "vllm_proxy_requests_total", mode="split", status="200") >= 1
        assert metric(proxy, "vllm_proxy_legs_total", leg="prefill") >= 1
        assert metric(proxy, "vllm_proxy_legs_total", leg="decode") >= 1


def test_the_next_turn_of_a_split_conversation_runs_on_one_node(stack: LocalStack) -> None:
    proxy = stack.proxies[0]
    first = prompt("conv")
    answer = complete(proxy, first, "turn-1").json()["choices"][0]["text"]
    complete(proxy, first + answer + " and then?", "turn-2")
    assert len(legs(stack, "turn-2")["whole"]) == 1  # a handful of new tokens: no transfer for them


def test_a_one_token_answer_is_never_split(stack: LocalStack) -> None:
    complete(stack.proxies[1], prompt("one"), "one-token", max_tokens=1)
    assert len(legs(stack, "one-token")["whole"]) == 1


def test_a_requests_two_legs_never_land_on_one_node(stack: LocalStack) -> None:
    # Many at once, through both replicas, so that loads and in-flight counts move between the decisions.
    ids = [f"burst-{i}" for i in range(24)]
    with ThreadPoolExecutor(12) as pool:
        answers = list(
            pool.map(
                lambda pair: complete(stack.proxies[pair[0] % 2], prompt(f"b{pair[0]}x"), pair[1], max_tokens=30),
                enumerate(ids),
            )
        )
    assert all(a.status_code == 200 for a in answers)
    pairs = []
    for request_id in ids:
        taken = legs(stack, request_id)
        if taken["whole"]:  # under load some run where they are prefilled (no_gain): one leg, one node
            assert taken == {"prefill": [], "decode": [], "whole": taken["whole"][:1]}, (request_id, taken)
            continue
        assert len(taken["prefill"]) == len(taken["decode"]) == 1, (request_id, taken)
        pairs.append((taken["prefill"][0], taken["decode"][0]))
    assert len(pairs) >= len(ids) // 2, pairs
    assert all(p != d for p, d in pairs), pairs


def test_replicas_agree_on_the_split_of_a_request_they_both_see(stack: LocalStack) -> None:
    one, two = stack.proxies
    for i in range(3):
        text = prompt(f"agree{i}x")
        seen = []
        for proxy in (one, two):
            wait_until(lambda: idle(stack), 15, "no request running or waiting on any node, by every replica")
            request_id = f"agree-{i}-{proxy.name}"
            complete(proxy, text, request_id)
            taken = legs(stack, request_id)
            seen.append((taken["prefill"], taken["decode"]))
        assert seen[0] == seen[1] and seen[0][0] != seen[0][1], seen


# -- a both node that dies mid-decode --------------------------------------------------------------------------------


@pytest.fixture
def static_trio(tmp_path: Path) -> Iterator[tuple[ProxyProc, list[SimNode]]]:
    nodes = [SimNode(tmp_path, f"both-{i}", role="both", itl=0.02).start() for i in range(3)]
    replica = ProxyProc(tmp_path, "--both", *(n.host_port for n in nodes), "--scrape-load", "0.1")
    try:
        for node in nodes:
            replica.wait_routable("both", node.host_port)
        yield replica, nodes
    finally:
        replica.stop()
        for node in nodes:
            node.stop()


def test_a_both_node_that_dies_mid_decode_is_resumed_on_another(
    static_trio: tuple[ProxyProc, list[SimNode]],
) -> None:
    replica, nodes = static_trio
    body = {
        "model": MODEL,
        "prompt": prompt("dies"),
        "max_tokens": 150,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    tokens, done = 0, False
    with httpx.stream("POST", f"{replica.url}/v1/completions", json=body, timeout=60) as answer:
        assert answer.status_code == 200
        decoder = next(n for n in nodes if n.host_port == answer.headers["x-sim-node"])
        assert "x-sim-prefill-engine" in answer.headers  # split: the node decoding pulled the KV from another
        for line in answer.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                assert '"error"' not in line, line
                tokens += 1
                if tokens == 10:
                    decoder.kill()
    assert done and tokens == 150
    assert metric_text(replica, 'vllm_proxy_resumes_total{outcome="resumed"}') == 1.0
    survivors = [n for n in nodes if n is not decoder]
    continued = [r for n in survivors for r in n.requests() if r["prompt_tokens"] > LONG and r["state"] == "done"]
    assert continued, "the continuation ran on a surviving node"


def metric_text(replica: ProxyProc, series: str) -> float:
    for line in replica.get("/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_static_flag_takes_both_nodes(tmp_path: Path) -> None:
    with SimNode(tmp_path, "solo", role="both") as node:
        replica = ProxyProc(tmp_path, "--both", node.host_port)
        try:
            replica.wait_routable("both", node.host_port)
            answer = replica.post("/v1/completions", json={"model": MODEL, "prompt": prompt("solo"), "max_tokens": 2})
            assert answer.status_code == 200 and answer.headers["x-sim-node"] == f"{HOST}:{node.port}"
            assert "x-sim-prefill-engine" not in answer.headers  # alone: nobody to split with
        finally:
            replica.stop()
