"""Node operations through the admin API (issue 31, part 1), on real processes: etcd, two replicas, simulated vLLM
nodes of two models. An operation by model reaches every node of that model and no other; without the admin key
none reaches a node; a sleep drains the node first, on both replicas, and loses no request of a load running
through both; a wake brings it back."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.aio import eventually
from tests.support.etcd_server import EtcdServer
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import DEV_MODE, RUNTIME_LORA, SimNode

KEY = "ops-key"
ADMIN = {"X-Api-Key": KEY}


class Fleet:
    def __init__(self, etcd: EtcdServer, nodes: dict[str, SimNode], replicas: list[ProxyProc]) -> None:
        self.etcd, self.nodes, self.replicas = etcd, nodes, replicas

    def admin(self, path: str, replica: int = 0, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.replicas[replica].url}{path}", headers=ADMIN, timeout=60.0, **kwargs)

    def seen(self, name: str, path: str) -> list[dict[str, Any]]:
        return [r for r in self.nodes[name].requests() if r["path"] == path]

    def record(self, name: str) -> dict[str, Any]:
        reply = json.loads(self.etcd.etcdctl("get", key_of(self.nodes[name]), "-w", "json"))
        value = base64.b64decode(reply["kvs"][0].get("value", ""))
        return json.loads(value) if value else {}


def key_of(node: SimNode) -> str:
    return f"/vllm/default/mixed/{node.host_port}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("node-ops")
    logs = root / "logs"
    logs.mkdir()
    etcd = EtcdServer(root / "etcd", logs)
    etcd.start()
    nodes = {
        "a1": SimNode(logs, "a1", env=DEV_MODE, model="alpha", itl=0.02, output_len=30),
        "a2": SimNode(
            logs, "a2", env={**DEV_MODE, **RUNTIME_LORA}, model="alpha", enable_lora=True, itl=0.02, output_len=30
        ),
        "b1": SimNode(logs, "b1", env=DEV_MODE, model="beta"),
    }
    replicas: list[ProxyProc] = []
    try:
        for node in nodes.values():
            node.start()
            etcd.etcdctl("put", key_of(node), "")  # bare keys: models learned from the nodes
        flags = ("--etcd", etcd.endpoint, "--scrape-load", "0.1")
        replicas = [ProxyProc(logs, *flags, name=f"proxy{i}", admin_key=KEY) for i in range(2)]
        for replica in replicas:
            for node in nodes.values():
                replica.wait_routable("mixed", node.host_port)
        yield Fleet(etcd, nodes, replicas)
    finally:
        for replica in replicas:
            replica.stop()
        for node in nodes.values():
            node.stop()
        etcd.stop()


def test_an_operation_by_model_reaches_every_node_of_it_and_no_other(fleet: Fleet) -> None:
    answer = fleet.admin("/admin/models/alpha/reset_prefix_cache")
    assert answer.status_code == 200
    body = answer.json()
    assert (body["op"], body["target"]) == ("reset_prefix_cache", "model alpha")
    by_node = {n["node"]: (n["status"], n["body"]) for n in body["nodes"]}
    alphas = {fleet.nodes[name].host_port for name in ("a1", "a2")}
    assert by_node == {host_port: (200, {"success": True}) for host_port in alphas}
    assert len(fleet.seen("a1", "/reset_prefix_cache")) == len(fleet.seen("a2", "/reset_prefix_cache")) == 1
    assert fleet.seen("b1", "/reset_prefix_cache") == []
    one = fleet.admin(f"/admin/nodes/{fleet.nodes['b1'].host_port}/start_profile", replica=1)
    assert one.status_code == 200 and [n["node"] for n in one.json()["nodes"]] == [fleet.nodes["b1"].host_port]
    assert fleet.seen("a1", "/start_profile") == fleet.seen("a2", "/start_profile") == []
    log = fleet.replicas[0].proc.log()
    assert "node operation op=reset_prefix_cache target=model alpha client=127.0.0.1 nodes=2" in log


def test_a_node_that_refuses_makes_the_answer_502_and_says_which(fleet: Fleet) -> None:
    adapter = json.dumps({"lora_name": "ops-lora", "lora_path": "/loras/ops"}).encode()
    answer = fleet.admin("/admin/models/alpha/load_lora_adapter", content=adapter)
    assert answer.status_code == 502
    statuses = {n["node"]: n["status"] for n in answer.json()["nodes"]}
    # a1 was started without VLLM_ALLOW_RUNTIME_LORA_UPDATING: vLLM has no such route there.
    assert statuses == {fleet.nodes["a1"].host_port: 404, fleet.nodes["a2"].host_port: 200}
    assert [r["status"] for r in fleet.seen("a2", "/v1/load_lora_adapter")] == [200]
    unknown = fleet.admin("/admin/models/gamma/sleep")
    assert unknown.status_code == 404 and "Known models: alpha, beta" in unknown.json()["error"]["message"]
    assert fleet.admin("/admin/models/alpha/collective_rpc").status_code == 404


def test_without_the_admin_key_node_operations_are_refused_and_reach_no_node(fleet: Fleet, logs_dir: Path) -> None:
    for name in fleet.nodes:
        fleet.nodes[name].clear_requests()
    url = fleet.replicas[0].url
    assert httpx.post(f"{url}/admin/models/alpha/sleep", timeout=10).status_code == 401
    wrong = httpx.post(f"{url}/admin/models/alpha/sleep", headers={"X-Api-Key": "nope"}, timeout=10)
    assert wrong.status_code == 401
    closed = ProxyProc(logs_dir, "--etcd", fleet.etcd.endpoint, name="no-admin-key")
    try:
        refused = httpx.post(f"{closed.url}/admin/models/alpha/sleep", headers=ADMIN, timeout=10)
        assert refused.status_code == 403 and "ADMIN_API_KEY" in refused.json()["error"]["message"]
    finally:
        closed.stop()
    assert all(node.requests() == [] for node in fleet.nodes.values())


def awake(replica: ProxyProc, node: SimNode) -> bool:
    return any(w["id"] == node.host_port and w["sleep"] == "awake" and not w["asleep"] for w in replica.workers())


async def stream(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str | None, bool]:
    """One streamed chat: (status, its last finish_reason, whether it ended with [DONE])."""
    body = {"model": "alpha", "messages": [{"role": "user", "content": f"load {i}"}], "stream": True}
    finish, done = None, False
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choices = json.loads(line[6:]).get("choices") or [{}]
                finish = choices[0].get("finish_reason") or finish
        return response.status_code, finish, done


async def test_a_sleep_under_load_loses_no_request_and_a_wake_brings_the_node_back(fleet: Fleet) -> None:
    a1 = fleet.nodes["a1"]
    results: list[tuple[int, str | None, bool]] = []
    stop = asyncio.Event()

    async def load(client: httpx.AsyncClient, worker: int) -> None:
        i = 0
        while not stop.is_set():
            results.append(await stream(client, fleet.replicas[worker % 2].url, worker * 1000 + i))
            i += 1

    async with httpx.AsyncClient(timeout=30.0) as client:
        workers = [asyncio.create_task(load(client, w)) for w in range(4)]
        await eventually(lambda: any(r["state"] == "running" for r in a1.requests()), 10.0, "a1 under load")
        answer = await asyncio.to_thread(fleet.admin, f"/admin/nodes/{a1.host_port}/sleep", params={"level": "1"})
        served_after = len(results)
        await eventually(lambda: len(results) >= served_after + 8, 20.0, "more requests after the sleep")
        stop.set()
        await asyncio.gather(*workers)
    assert answer.status_code == 200, answer.text
    (node,) = answer.json()["nodes"]
    assert (node["status"], node["body"]) == (200, {"status": "sleeping", "level": 1})
    assert results and all(r == (200, "stop", True) for r in results), [r for r in results if r[0] != 200]
    sleeps = fleet.seen("a1", "/sleep")
    assert len(sleeps) == 1 and sleeps[0]["query"] == "level=1&mode=wait"
    assert httpx.get(f"{a1.url}/is_sleeping", timeout=5).json() == {"is_sleeping": True}
    assert fleet.record("a1")["sleep"] == "asleep"
    # Nothing reached a1 once it was asleep: every chat of the load after the sleep went to a2.
    asleep_at = sleeps[0]["received_at"]
    assert not [r for r in a1.requests() if r["path"] == "/v1/chat/completions" and r["received_at"] > asleep_at]
    for replica in fleet.replicas:
        assert any(w["id"] == a1.host_port and w["sleep"] == "asleep" for w in replica.workers())

    woken = fleet.admin(f"/admin/nodes/{a1.host_port}/wake_up", replica=1)
    assert woken.status_code == 200 and woken.json()["nodes"][0]["body"] == {"status": "awake", "tags": None}
    assert "sleep" not in fleet.record("a1")
    for replica in fleet.replicas:
        wait_until(lambda r=replica: awake(r, a1), 5, f"a1 awake on {replica.proc.name}")
    page = fleet.replicas[0].get("/metrics").text
    assert 'vllm_proxy_node_sleeps_total{model="alpha",outcome="ok",reason="admin"} 1.0' in page
