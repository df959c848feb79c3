"""LoRA adapters, the parts issue 31 adds, on real processes (etcd, replicas, simulated vLLM nodes loading adapters
at run time): the Responses API loads an adapter as chat does; a disaggregated base model gets its adapter on the
prefill and on the decode node before the legs run; a node at its adapter slots unloads its least recently used
registered adapter (never one in flight) first; an unregistered adapter leaves the nodes; one load per burst holds
across replicas whose views of the nodes' loads disagree."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.etcd_server import EtcdServer
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import RUNTIME_LORA, SimNode

MODEL = "sim-model"
ADAPTERS = "/vllm/default/adapters/"


class Fleet:
    def __init__(self, etcd: EtcdServer, nodes: list[SimNode], replicas: list[ProxyProc]) -> None:
        self.etcd, self.nodes, self.replicas = etcd, nodes, replicas

    def register(self, *names: str) -> None:
        for name in names:
            self.etcd.etcdctl("put", ADAPTERS + name, json.dumps({"path": f"/loras/{name}", "base": MODEL}))
        for replica in self.replicas:
            wait_until(lambda r=replica: all(n in r.get("/v1/models").text for n in names), 5, "adapters listed")

    def calls(self, node: SimNode, path: str) -> list[dict[str, Any]]:
        return [r for r in node.requests() if r["path"] == path]

    def held(self, node: SimNode) -> set[str]:
        cards = httpx.get(f"{node.url}/v1/models", timeout=5).json()["data"]
        return {c["id"] for c in cards if c.get("parent")}


def start_fleet(etcd: EtcdServer, logs: Path, roles: list[str], replicas: int, *flags: str, **knobs: Any) -> Fleet:
    nodes = [
        SimNode(logs, f"{role}-{i}", env=RUNTIME_LORA, role=role, enable_lora=True, **knobs)
        for i, role in enumerate(roles)
    ]
    fleet = Fleet(etcd, nodes, [])
    for node, role in zip(nodes, roles, strict=True):
        node.start()
        etcd.etcdctl("put", f"/vllm/default/{role}/{node.host_port}", "")
    for i in range(replicas):
        fleet.replicas.append(ProxyProc(logs, "--etcd", etcd.endpoint, *flags, name=f"proxy{i}"))
    for replica in fleet.replicas:
        for node, role in zip(nodes, roles, strict=True):
            replica.wait_routable(role, node.host_port)
    return fleet


@contextlib.contextmanager
def running(fleet_: Fleet) -> Iterator[Fleet]:
    try:
        yield fleet_
    finally:
        for replica in fleet_.replicas:
            replica.stop()
        for node in fleet_.nodes:
            node.stop()


@pytest.fixture
def mixed(etcd: EtcdServer, logs_dir: Path) -> Iterator[Fleet]:
    """One mixed node with two adapter slots, one replica scraping its load (and so its slots)."""
    with running(start_fleet(etcd, logs_dir, ["mixed"], 1, "--scrape-load", "0.1", max_loras=2)) as fleet:
        replica = fleet.replicas[0]
        wait_until(lambda: all(w["node_load"] for w in replica.workers()), 10, "a first scrape of the node")
        yield fleet


def chat(fleet: Fleet, model: str, replica: int = 0, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    return fleet.replicas[replica].post("/v1/chat/completions", json=body)


def test_a_responses_request_naming_an_adapter_loads_it_first(mixed: Fleet) -> None:
    (node,) = mixed.nodes
    mixed.register("resp-lora")
    answer = mixed.replicas[0].post(
        "/v1/responses", json={"model": "resp-lora", "input": "hello", "max_output_tokens": 4}
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "resp-lora"
    (load,) = mixed.calls(node, "/v1/load_lora_adapter")
    (response,) = mixed.calls(node, "/v1/responses")
    assert load["status"] == 200 and response["model"] == "resp-lora" and load["received_at"] < response["received_at"]


def test_a_node_at_its_adapter_slots_unloads_its_least_recently_used_adapter_first(mixed: Fleet) -> None:
    (node,) = mixed.nodes
    mixed.register("lru-a", "lru-b", "lru-c")
    for name in ("lru-a", "lru-b", "lru-a"):  # lru-b is now the least recently used
        assert chat(mixed, name).status_code == 200
    assert mixed.held(node) == {"lru-a", "lru-b"}
    answer = chat(mixed, "lru-c")
    assert (answer.status_code, answer.json()["model"]) == (200, "lru-c")
    assert mixed.held(node) == {"lru-a", "lru-c"}
    (unload,) = mixed.calls(node, "/v1/unload_lora_adapter")
    load_c = [r for r in mixed.calls(node, "/v1/load_lora_adapter") if r["received_at"] > unload["received_at"]]
    assert unload["status"] == 200 and len(load_c) == 1  # room made first, then the load
    page = mixed.replicas[0].get("/metrics").text
    assert 'vllm_proxy_adapter_loads_total{adapter="lru-b",outcome="unloaded"} 1.0' in page


async def test_an_adapter_in_flight_is_never_the_one_unloaded(mixed: Fleet) -> None:
    (node,) = mixed.nodes
    mixed.register("busy-a", "busy-b", "busy-c")
    node.configure(itl=0.02)
    long = {"model": "busy-a", "prompt": "a long answer", "max_tokens": 150, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60.0) as client:
        streaming = asyncio.create_task(client.post(f"{mixed.replicas[0].url}/v1/completions", json=long))
        await asyncio.to_thread(node.wait_for_request, 10.0, model="busy-a", state="running")
        assert (await asyncio.to_thread(chat, mixed, "busy-b")).status_code == 200  # busy-a is now the LRU
        answer = await asyncio.to_thread(chat, mixed, "busy-c")
        done = await streaming
    assert answer.status_code == 200 and done.status_code == 200
    assert done.json()["usage"]["completion_tokens"] == 150
    # busy-a was the least recently used, but in flight: busy-b made room.
    assert mixed.held(node) == {"busy-a", "busy-c"} and len(mixed.calls(node, "/v1/unload_lora_adapter")) == 1


def test_an_unregistered_adapter_is_unloaded_from_the_nodes_that_have_it_within_a_minute(mixed: Fleet) -> None:
    (node,) = mixed.nodes
    mixed.register("gone-lora")
    assert chat(mixed, "gone-lora").status_code == 200
    assert "gone-lora" in mixed.held(node)
    mixed.etcd.etcdctl("del", ADAPTERS + "gone-lora")
    wait_until(lambda: "gone-lora" not in mixed.held(node), 60, "the adapter unloaded from its node")
    assert [r["status"] for r in mixed.calls(node, "/v1/unload_lora_adapter")] == [200]


def test_a_disaggregated_base_models_adapter_is_loaded_on_the_prefill_and_the_decode_node_first(
    etcd: EtcdServer, logs_dir: Path
) -> None:
    with running(start_fleet(etcd, logs_dir, ["prefill", "decode"], 1)) as fleet:
        prefill, decode = fleet.nodes
        fleet.register("pd-lora")
        answer = chat(fleet, "pd-lora", stream=False)
        assert (answer.status_code, answer.json()["model"]) == (200, "pd-lora"), answer.text
        for node in (prefill, decode):
            (load,) = fleet.calls(node, "/v1/load_lora_adapter")
            (leg,) = fleet.calls(node, "/v1/chat/completions")
            assert load["status"] == 200 and leg["model"] == "pd-lora" and load["received_at"] < leg["received_at"]
        (prefill_leg,) = fleet.calls(prefill, "/v1/chat/completions")
        (decode_leg,) = fleet.calls(decode, "/v1/chat/completions")
        assert prefill_leg["kv_transfer_params"]["do_remote_decode"] is True
        assert decode_leg["prefill"]["remote_engine_id"] == prefill.engine_id


@contextlib.asynccontextmanager
async def held_on(client: httpx.AsyncClient, replica: ProxyProc, wanted: str) -> AsyncIterator[None]:
    """A long stream through ``replica`` that landed on node ``wanted`` (others it tried are closed), held open."""
    body = {"model": MODEL, "prompt": "hold", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    for _ in range(6):
        stream = client.stream("POST", f"{replica.url}/v1/completions", json=body)
        response = await stream.__aenter__()
        if response.headers["x-sim-node"] == wanted:
            try:
                yield
            finally:
                await stream.__aexit__(None, None, None)
            return
        await stream.__aexit__(None, None, None)
    raise AssertionError(f"no stream through {replica.proc.name} landed on {wanted}")


async def test_one_load_per_burst_holds_across_replicas_whose_loads_disagree(etcd: EtcdServer, logs_dir: Path) -> None:
    flags = ("--scrape-load", "0", "--mixed-policy", "least-load")
    with running(start_fleet(etcd, logs_dir, ["mixed", "mixed"], 2, *flags, itl=0.01)) as fleet:
        one, two = fleet.replicas
        x, y = fleet.nodes
        fleet.register("burst-lora")
        async with httpx.AsyncClient(timeout=60.0) as client:
            # Replica one sees x busy and y idle, replica two the other way round: left to their own views, each
            # would load the adapter on another node.
            async with held_on(client, one, x.host_port), held_on(client, two, y.host_port):
                body = {"model": "burst-lora", "prompt": "burst", "max_tokens": 2}
                answers = await asyncio.gather(
                    *(client.post(f"{fleet.replicas[i % 2].url}/v1/completions", json=body) for i in range(16))
                )
        assert [a.status_code for a in answers] == [200] * 16
        loads = [r for n in fleet.nodes for r in fleet.calls(n, "/v1/load_lora_adapter")]
        assert [r["status"] for r in loads] == [200]
        assert len({a.headers["x-sim-node"] for a in answers}) == 1
