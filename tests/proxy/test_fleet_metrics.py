"""The fleet's metrics on a replica (issue 21): each node's scraped load as ``vllm_proxy_node_*{node, role,
model}``, gone when the node leaves; and completions measured as their clients see them, by model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.etcd_server import EtcdServer
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MODEL = "sim-model"
NODE_GAUGES = (
    "vllm_proxy_node_running",
    "vllm_proxy_node_waiting",
    "vllm_proxy_node_kv_cache_usage",
    "vllm_proxy_node_scrape_age_seconds",
    "vllm_proxy_node_routable",
)


def samples(proxy: ProxyProc) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(proxy.get("/metrics").text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def value(proxy: ProxyProc, name: str, **labels: str) -> float | None:
    for found, number in samples(proxy).get(name, []):
        if all(found.get(k) == v for k, v in labels.items()):
            return number
    return None


@pytest.fixture
def fleet(etcd: EtcdServer, logs_dir: Path) -> Iterator[tuple[ProxyProc, list[SimNode]]]:
    nodes = [SimNode(logs_dir, f"mixed-{i}", role="mixed", output_len=8) for i in range(2)]
    proxy = None
    try:
        for node in nodes:
            node.start()
            etcd.etcdctl("put", f"/vllm/default/mixed/{node.host_port}", "")
        proxy = ProxyProc(logs_dir, "--etcd", etcd.endpoint, "--scrape-load", "0.1")
        for node in nodes:
            proxy.wait_routable("mixed", node.host_port)
        yield proxy, nodes
    finally:
        if proxy is not None:
            proxy.stop()
        for node in nodes:
            node.stop()


def test_each_nodes_gauges_are_on_the_replica_and_a_node_that_leaves_leaves_them(
    fleet: tuple[ProxyProc, list[SimNode]], etcd: EtcdServer
) -> None:
    proxy, nodes = fleet
    ids = {n.host_port for n in nodes}

    def nodes_in(name: str) -> set[str]:
        return {labels["node"] for labels, _ in samples(proxy).get(name, [])}

    wait_until(lambda: all(nodes_in(name) == ids for name in NODE_GAUGES), 10, "every node's gauges")
    for labels, _ in samples(proxy)["vllm_proxy_node_running"]:
        assert (labels["role"], labels["model"]) == ("mixed", MODEL)
    assert value(proxy, "vllm_proxy_model_routable_nodes", model=MODEL, role="mixed") == 2
    # The same prompt twice: the second hits the prefix cache of whichever node took it.
    for _ in range(4):
        body = {"model": MODEL, "prompt": "the same long prompt " * 20, "max_tokens": 2}
        assert httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=10).status_code == 200
    wait_until(
        lambda: any(v > 0 for _, v in samples(proxy).get("vllm_proxy_node_prefix_cache_hit_rate", [])),
        10,
        "a prefix-cache hit rate above 0",
    )

    gone = nodes[0].host_port
    etcd.etcdctl("del", f"/vllm/default/mixed/{gone}")
    proxy.wait_gone("mixed", gone)
    for name in (*NODE_GAUGES, "vllm_proxy_node_prefix_cache_hit_rate"):
        assert gone not in nodes_in(name), f"{name} still shows the node that left"
    assert all(nodes_in(name) == {nodes[1].host_port} for name in NODE_GAUGES)
    assert value(proxy, "vllm_proxy_model_routable_nodes", model=MODEL, role="mixed") == 1


def test_completions_are_measured_by_model_as_their_clients_see_them(fleet: tuple[ProxyProc, list[SimNode]]) -> None:
    proxy, _ = fleet
    stream = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for body in (stream, {**stream, "stream": False, "stream_options": None}):
        answer = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, timeout=10)
        assert answer.status_code == 200
    assert value(proxy, "vllm_proxy_e2e_request_latency_seconds_count", model=MODEL) == 2
    assert value(proxy, "vllm_proxy_time_to_first_token_seconds_count", model=MODEL) == 1  # the stream only
    assert value(proxy, "vllm_proxy_inter_token_latency_seconds_count", model=MODEL) == 1
    assert value(proxy, "vllm_proxy_generation_tokens_total", model=MODEL) == 12
    prompt = value(proxy, "vllm_proxy_prompt_tokens_total", model=MODEL)
    assert prompt is not None and prompt > 0
    itl = value(proxy, "vllm_proxy_inter_token_latency_seconds_sum", model=MODEL)
    e2e = value(proxy, "vllm_proxy_e2e_request_latency_seconds_sum", model=MODEL)
    assert itl is not None and e2e is not None and 0 < itl < e2e
