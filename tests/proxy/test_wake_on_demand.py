"""Sleeping nodes woken on demand (issue 31, part 2), on real processes: etcd, two replicas with --wake-on-demand,
simulated vLLM nodes in vLLM's sleep mode. A burst for a model whose nodes all sleep wakes exactly one node, fleet
-wide, and every request of it succeeds; a node that fails to wake is skipped for the next; a wake that takes
longer than --wake-timeout answers 503 with Retry-After."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.support.etcd_server import EtcdServer
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import DEV_MODE, SimNode
from vllm_etcd_proxy.proxy.routing.balancer import _stable_hash

KEY = "wake-key"
MODEL = "sleepy"


class Fleet:
    def __init__(self, etcd: EtcdServer, nodes: list[SimNode], replicas: list[ProxyProc]) -> None:
        self.etcd, self.nodes, self.replicas = etcd, nodes, replicas

    def sleep_all(self) -> None:
        """Every node drained and put to sleep through the admin API, and seen so by both replicas."""
        answer = httpx.post(
            f"{self.replicas[0].url}/admin/models/{MODEL}/sleep", headers={"X-Api-Key": KEY}, timeout=60.0
        )
        assert answer.status_code == 200, answer.text
        for replica in self.replicas:
            wait_until(lambda r=replica: asleep(r) == len(self.nodes), 10, f"all nodes asleep on {replica.proc.name}")
        for node in self.nodes:
            node.clear_requests()

    def wakes(self, node: SimNode) -> list[int]:
        return [r["status"] for r in node.requests() if r["path"] == "/wake_up"]


def asleep(replica: ProxyProc) -> int:
    return sum(1 for w in replica.workers() if w["sleep"] == "asleep")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("wake")
    logs = root / "logs"
    logs.mkdir()
    etcd = EtcdServer(root / "etcd", logs)
    etcd.start()
    nodes = [SimNode(logs, f"sleepy-{i}", env=DEV_MODE, model=MODEL, wake_time=0.5) for i in range(3)]
    replicas: list[ProxyProc] = []
    try:
        for node in nodes:
            node.start()
            etcd.etcdctl("put", f"/vllm/default/mixed/{node.host_port}", "")
        flags = ("--etcd", etcd.endpoint, "--scrape-load", "0.1", "--wake-on-demand", "--wake-timeout", "20")
        replicas = [ProxyProc(logs, *flags, name=f"proxy{i}", admin_key=KEY) for i in range(2)]
        for replica in replicas:
            for node in nodes:
                replica.wait_routable("mixed", node.host_port)
        yield Fleet(etcd, nodes, replicas)
    finally:
        for replica in replicas:
            replica.stop()
        for node in nodes:
            node.stop()
        etcd.stop()


def in_wake_order(nodes: list[SimNode]) -> list[SimNode]:
    """The order every replica tries the nodes in (mixed nodes by a hash of model and node id)."""
    return sorted(nodes, key=lambda n: _stable_hash(f"{MODEL}#{n.host_port}"))


async def burst(fleet: Fleet, count: int) -> list[httpx.Response]:
    body = {"model": MODEL, "prompt": "wake up", "max_tokens": 2}
    async with httpx.AsyncClient(timeout=60.0) as client:
        return await asyncio.gather(
            *(client.post(f"{fleet.replicas[i % 2].url}/v1/completions", json=body) for i in range(count))
        )


async def test_a_burst_for_a_sleeping_model_wakes_exactly_one_node_and_every_request_succeeds(fleet: Fleet) -> None:
    fleet.sleep_all()
    answers = await burst(fleet, 16)
    assert [a.status_code for a in answers] == [200] * 16
    woken = [n for n in fleet.nodes if fleet.wakes(n)]
    assert len(woken) == 1 and fleet.wakes(woken[0]) == [200]
    assert {a.headers["x-sim-node"] for a in answers} == {woken[0].host_port}
    for node in fleet.nodes:
        sleeping = httpx.get(f"{node.url}/is_sleeping", timeout=5).json()["is_sleeping"]
        assert sleeping is (node is not woken[0])
    waited = 0.0
    for replica in fleet.replicas:
        for line in replica.get("/metrics").text.splitlines():
            if line.startswith(f'vllm_proxy_wake_waits_total{{model="{MODEL}",outcome="served"}}'):
                waited += float(line.rsplit(" ", 1)[1])
    assert waited >= 1  # the burst's first requests waited for the wake


async def test_a_node_that_fails_to_wake_is_skipped_and_the_next_one_woken(fleet: Fleet) -> None:
    fleet.sleep_all()
    first, second, _ = in_wake_order(fleet.nodes)
    first.configure(wake_fail=500)
    try:
        answers = await burst(fleet, 6)
    finally:
        first.configure(wake_fail=0)
    assert [a.status_code for a in answers] == [200] * 6
    assert fleet.wakes(first) == [500] and fleet.wakes(second) == [200]
    assert {a.headers["x-sim-node"] for a in answers} == {second.host_port}


async def test_a_wake_longer_than_the_wake_timeout_is_a_503_with_retry_after(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    fleet.sleep_all()
    for node in fleet.nodes:
        node.configure(wake_time=8.0)
    logs = tmp_path_factory.mktemp("impatient")
    impatient = ProxyProc(
        logs, "--etcd", fleet.etcd.endpoint, "--wake-on-demand", "--wake-timeout", "1", name="impatient"
    )
    try:
        wait_until(lambda: asleep(impatient) == len(fleet.nodes), 10, "the nodes asleep on the new replica")
        answer = impatient.post("/v1/completions", json={"model": MODEL, "prompt": "now", "max_tokens": 2})
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "wake_timeout"
        assert 'vllm_proxy_wake_waits_total{model="sleepy",outcome="timeout"} 1.0' in impatient.get("/metrics").text
    finally:
        impatient.stop()


def test_without_etcd_a_node_put_to_sleep_by_hand_is_woken_by_the_next_request(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    logs = tmp_path_factory.mktemp("static-wake")
    with SimNode(logs, "by-hand", env=DEV_MODE, model=MODEL) as node:
        node.sleep(level=2)
        replica = ProxyProc(logs, "--mixed", node.host_port, "--scrape-load", "0.1", "--wake-on-demand", name="static")
        try:
            wait_until(lambda: any(w["asleep"] for w in replica.workers()), 10, "the node seen asleep")
            answer = replica.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
            assert answer.status_code == 200 and answer.headers["x-sim-node"] == node.host_port
            assert [r["status"] for r in node.requests() if r["path"] == "/wake_up"] == [200]
        finally:
            replica.stop()
