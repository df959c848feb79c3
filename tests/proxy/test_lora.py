"""LoRA adapters as fleet citizens (issue 19), on real processes: etcd, two replicas, simulated vLLM nodes that
load adapters at run time. An adapter written to etcd is listed at once, loaded on one node by its first
requests (however many arrive together, through whichever replica), loaded again on a node that restarted
without it, and moved to another node when a load fails."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.aio import eventually
from tests.support.etcd_server import EtcdServer
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import RUNTIME_LORA, SimNode
from vllm_etcd_proxy.proxy.routing.balancer import _stable_hash

MODEL = "sim-model"
ADAPTERS = "/vllm/default/adapters/"


class Fleet:
    def __init__(self, replicas: list[ProxyProc], nodes: list[SimNode], etcd: EtcdServer) -> None:
        self.replicas, self.nodes, self.etcd = replicas, nodes, etcd

    def register(self, name: str, path: str | None = None) -> None:
        self.etcd.etcdctl("put", ADAPTERS + name, json.dumps({"path": path or f"/loras/{name}", "base": MODEL}))

    def loads(self, node: SimNode) -> list[dict[str, object]]:
        return [r for r in node.requests() if r["path"] == "/v1/load_lora_adapter"]

    def holders(self, name: str) -> list[SimNode]:
        return [n for n in self.nodes if name in {c["id"] for c in httpx.get(f"{n.url}/v1/models").json()["data"]}]


@pytest.fixture
def fleet(etcd: EtcdServer, logs_dir: Path) -> Iterator[Fleet]:
    nodes = [
        SimNode(
            logs_dir, f"lora-{i}", env=RUNTIME_LORA, enable_lora=True, max_loras=2, lora_load_time=0.3, output_len=4
        )
        for i in range(2)
    ]
    replicas: list[ProxyProc] = []
    try:
        for node in nodes:
            node.start()
            etcd.etcdctl("put", f"/vllm/default/mixed/{node.host_port}", "")
        replicas = [
            ProxyProc(logs_dir, "--etcd", etcd.endpoint, "--scrape-load", "0.1", name=f"proxy{i}") for i in range(2)
        ]
        for replica in replicas:
            for node in nodes:
                replica.wait_routable("mixed", node.host_port)
        yield Fleet(replicas, nodes, etcd)
    finally:
        for replica in replicas:
            replica.stop()
        for node in nodes:
            node.stop()


async def ask(client: httpx.AsyncClient, replica: ProxyProc, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return await client.post(f"{replica.url}/v1/chat/completions", json=body, timeout=30.0)


async def test_an_adapter_put_in_etcd_is_listed_by_both_replicas_within_a_second(fleet: Fleet) -> None:
    fleet.register("sql")
    async with httpx.AsyncClient() as client:

        async def listed() -> bool:
            for replica in fleet.replicas:
                cards = {c["id"]: c for c in (await client.get(f"{replica.url}/v1/models")).json()["data"]}
                if cards.get("sql", {}).get("parent") != MODEL:
                    return False
            return True

        await eventually(listed, 1.0, "adapter sql on both replicas' /v1/models")
        card = (await client.get(f"{fleet.replicas[1].url}/v1/models/sql")).json()
        assert (card["id"], card["root"], card["parent"], card["object"]) == ("sql", "/loras/sql", MODEL, "model")
    assert fleet.holders("sql") == []  # listed before any node loaded it


async def test_sixteen_first_requests_through_two_replicas_load_the_adapter_once_on_one_node(fleet: Fleet) -> None:
    fleet.register("chat")
    await eventually(lambda: all("chat" in r.get("/v1/models").text for r in fleet.replicas), 5.0, "listed")
    async with httpx.AsyncClient() as client:
        answers = await asyncio.gather(*(ask(client, fleet.replicas[i % 2], "chat") for i in range(16)))
    assert [(a.status_code, a.json()["model"]) for a in answers] == [(200, "chat")] * 16
    assert sum(n.snapshot()["counters"].get("lora_loads", 0) for n in fleet.nodes) == 1
    (holder,) = fleet.holders("chat")
    assert {str(r["status"]) for n in fleet.nodes if n is not holder for r in fleet.loads(n)} == set()
    served = {r["model"] for n in fleet.nodes for r in n.requests() if r["path"] == "/v1/chat/completions"}
    assert served == {"chat"}


async def test_a_node_restarted_without_the_adapter_gets_it_again_on_demand(fleet: Fleet) -> None:
    fleet.register("again")
    async with httpx.AsyncClient() as client:
        assert (await ask(client, fleet.replicas[0], "again")).status_code == 200
        (holder,) = fleet.holders("again")
        holder.restart()
        assert fleet.holders("again") == []
        answer = await ask(client, fleet.replicas[0], "again")
    assert (answer.status_code, answer.json()["model"]) == (200, "again")
    assert holder in fleet.holders("again") and holder.snapshot()["counters"]["lora_loads"] == 1


async def test_a_failed_load_moves_to_another_node_and_a_load_failing_everywhere_is_a_clear_error(
    fleet: Fleet,
) -> None:
    first, second = fleet.nodes
    # A name the replicas would load on ``first`` (ties are broken by a hash of adapter and node id).
    name = next(
        f"a{i}"
        for i in range(100)
        if _stable_hash(f"a{i}#{first.host_port}") > _stable_hash(f"a{i}#{second.host_port}")
    )
    first.configure(lora_load_fail=500)
    fleet.register(name)
    async with httpx.AsyncClient() as client:
        await eventually(lambda: name in fleet.replicas[0].get("/v1/models").text, 5.0, "listed")
        answer = await ask(client, fleet.replicas[0], name)
        assert (answer.status_code, answer.json()["model"]) == (200, name)
        assert [r["status"] for r in fleet.loads(first)] == [500] and fleet.holders(name) == [second]
        page = fleet.replicas[0].get("/metrics").text
        for outcome in ("failed", "loaded"):
            assert f'vllm_proxy_adapter_loads_total{{adapter="{name}",outcome="{outcome}"}} 1.0' in page
        second.configure(lora_load_fail=404)
        fleet.register("broken", "/no/such/adapter")
        await eventually(lambda: "broken" in fleet.replicas[1].get("/v1/models").text, 5.0, "listed")
        failed = await ask(client, fleet.replicas[1], "broken")
    error = failed.json()["error"]
    assert failed.status_code == 502 and "LoRA adapter 'broken' could not be loaded" in error["message"]
    assert "No adapter found for /no/such/adapter" in error["message"]


async def test_an_unknown_adapter_gets_vllms_404_listing_the_known_models(fleet: Fleet) -> None:
    fleet.etcd.etcdctl("put", ADAPTERS + "orphan", json.dumps({"path": "/loras/orphan", "base": "other"}))
    fleet.register("known")  # once listed, the replica has seen the orphan put before it too
    await eventually(lambda: "known" in fleet.replicas[0].get("/v1/models").text, 5.0, "listed")
    async with httpx.AsyncClient() as client:
        answer = await ask(client, fleet.replicas[0], "unknown")
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert error["message"] == f"The model `unknown` does not exist. Known models: known, {MODEL}."
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
        orphan = await ask(client, fleet.replicas[0], "orphan")  # its base model is served nowhere: unknown too
        assert orphan.status_code == 404 and "orphan" not in fleet.replicas[0].get("/v1/models").text
        fleet.etcd.etcdctl("del", ADAPTERS + "known")  # unregistered: never loaded from now on
        await eventually(lambda: "known" not in fleet.replicas[0].get("/v1/models").text, 5.0, "unlisted")
        assert (await ask(client, fleet.replicas[0], "known")).status_code == 404
    assert all(fleet.loads(n) == [] for n in fleet.nodes)


async def test_an_adapter_the_nodes_list_themselves_goes_to_the_node_where_it_is_active(
    etcd: EtcdServer, logs_dir: Path
) -> None:
    nodes = [
        SimNode(logs_dir, f"own-{i}", enable_lora=True, max_loras=2, lora_modules=["own=/loras/own"], itl=0.02)
        for i in range(2)
    ]
    replica = None
    try:
        for node in nodes:
            node.start()
            etcd.etcdctl("put", f"/vllm/default/mixed/{node.host_port}", "")
        replica = ProxyProc(logs_dir, "--etcd", etcd.endpoint, "--scrape-load", "0.1")
        for node in nodes:
            replica.wait_routable("mixed", node.host_port)
        idle, busy = nodes
        long = {"model": "own", "prompt": "long", "max_tokens": 400, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30.0) as client:
            running = asyncio.create_task(client.post(f"{busy.url}/v1/completions", json=long))  # straight to it
            try:

                async def next_five_on_busy() -> bool:
                    picked = []
                    for i in range(5):
                        short = {"model": "own", "prompt": f"q{i}", "max_tokens": 2}
                        answer = await client.post(f"{replica.url}/v1/completions", json=short)
                        picked.append(answer.headers["x-sim-node"])
                    return set(picked) == {busy.host_port}

                await eventually(next_five_on_busy, 5.0, "the adapter's requests on the node where it is active")
            finally:
                running.cancel()
        assert not [r for r in idle.requests() if r["path"] == "/v1/completions" and r["state"] == "running"]
    finally:
        if replica is not None:
            replica.stop()
        for node in nodes:
            node.stop()
