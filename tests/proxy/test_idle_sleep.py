"""Sleep after idle with wake on demand (issue 31, part 2): two models time-share one simulated GPU, on real
processes (etcd, two replicas, two vllm-sim nodes sharing a ``--gpu`` that holds one of them at a time). Model
alpha's node sleeps once idle, beta's wakes on its first request, then the other way round; no request fails, and
the GPU never holds both (a wake that did not fit would fail as CUDA's out of memory, and its request with it)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.faults.fleet import holds
from tests.support.etcd_server import EtcdServer
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import DEV_MODE, SimNode

GIB = 1 << 30


class Fleet:
    def __init__(self, nodes: dict[str, SimNode], replicas: list[ProxyProc]) -> None:
        self.nodes, self.replicas = nodes, replicas

    def ask(self, model: str, replica: int) -> httpx.Response:
        body = {"model": model, "prompt": f"hello {model}", "max_tokens": 2}
        return self.replicas[replica].post("/v1/completions", json=body)

    def sleeping(self, model: str) -> bool:
        return bool(httpx.get(f"{self.nodes[model].url}/is_sleeping", timeout=5).json()["is_sleeping"])


@pytest.fixture
def fleet(etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("time-share")
    gpu = {"gpu": logs / "gpu0", "gpu_capacity_gib": 3.0, "wake_time": 0.3}
    nodes = {model: SimNode(logs, model, env=DEV_MODE, model=model, **gpu) for model in ("beta", "alpha")}
    replicas: list[ProxyProc] = []
    try:
        nodes["beta"].start().sleep(level=1)  # the GPU holds one model at a time: beta sleeps so alpha can start
        nodes["alpha"].start()
        for node in nodes.values():
            etcd.etcdctl("put", f"/vllm/default/mixed/{node.host_port}", "")
        flags = ("--etcd", etcd.endpoint, "--scrape-load", "0.1", "--wake-on-demand", "--sleep-after-idle", "2")
        replicas = [ProxyProc(logs, *flags, "--min-awake", "0", name=f"proxy{i}") for i in range(2)]
        for replica in replicas:
            for node in nodes.values():
                replica.wait_routable("mixed", node.host_port)
        nodes["beta"].clear_requests()  # its sleep by hand above
        yield Fleet(nodes, replicas)
    finally:
        for replica in replicas:
            replica.stop()
        for node in nodes.values():
            node.stop()


def test_two_models_time_share_one_gpu_through_idle_sleep_and_wake_on_demand(fleet: Fleet) -> None:
    alpha, beta = fleet.nodes["alpha"], fleet.nodes["beta"]
    assert (alpha.gpu_memory(), beta.gpu_memory()) == (2 * GIB, 0)
    assert fleet.ask("alpha", 0).status_code == 200
    wait_until(lambda: fleet.sleeping("alpha"), 15, "alpha's node asleep once idle")
    assert alpha.gpu_memory() == 0
    for turn in range(2):
        answer = fleet.ask("beta", turn)  # its first request wakes it, through either replica
        assert (answer.status_code, answer.headers["x-sim-node"]) == (200, beta.host_port), answer.text
        assert (alpha.gpu_memory(), beta.gpu_memory()) == (0, 2 * GIB)
    wait_until(lambda: fleet.sleeping("beta"), 15, "beta's node asleep once idle")
    answer = fleet.ask("alpha", 1)
    assert (answer.status_code, answer.headers["x-sim-node"]) == (200, alpha.host_port), answer.text
    assert (alpha.gpu_memory(), beta.gpu_memory()) == (2 * GIB, 0)
    for node in (alpha, beta):  # every wake fitted on the GPU
        assert {r["status"] for r in node.requests() if r["path"] == "/wake_up"} == {200}
    sleeps = [r["query"] for n in (alpha, beta) for r in n.requests() if r["path"] == "/sleep"]
    assert sleeps == ["level=1&mode=wait", "level=1&mode=wait"]  # each slept once, by one replica
    metrics = "".join(r.get("/metrics").text for r in fleet.replicas)
    assert metrics.count('vllm_proxy_node_sleeps_total{model="alpha",outcome="ok",reason="idle"} 1.0') == 1


def test_min_awake_keeps_a_model_s_last_node_awake(etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> None:
    logs = tmp_path_factory.mktemp("min-awake")
    nodes = [SimNode(logs, f"kept-{i}", env=DEV_MODE, model="kept") for i in range(2)]
    replica = None
    try:
        for node in nodes:
            node.start()
            etcd.etcdctl("put", f"/vllm/default/mixed/{node.host_port}", "")
        flags = ("--etcd", etcd.endpoint, "--scrape-load", "0.1", "--sleep-after-idle", "kept=1")
        replica = ProxyProc(logs, *flags, name="min-awake")  # --min-awake 1 by default
        asleep = lambda: sum(w["sleep"] == "asleep" for w in replica.workers())  # noqa: E731
        wait_until(lambda: asleep() == 1, 15, "one node asleep")
        holds(lambda: asleep() == 1, 3.0, "the other node awake, idle for three times --sleep-after-idle")
        awake = [n for n in nodes if not httpx.get(f"{n.url}/is_sleeping", timeout=5).json()["is_sleeping"]]
        assert len(awake) == 1
        answer = replica.post("/v1/completions", json={"model": "kept", "prompt": "still here", "max_tokens": 2})
        assert (answer.status_code, answer.headers["x-sim-node"]) == (200, awake[0].host_port)
    finally:
        if replica is not None:
            replica.stop()
        for node in nodes:
            node.stop()
