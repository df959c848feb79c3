"""With every node of a model full, requests wait in the replica: by priority, tenant by tenant, bounded."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.proxy.test_tenants import metric
from tests.support.procs import HOST, wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MODEL, OTHER = "sim-model", "other-model"


def chat(model: str = MODEL, max_tokens: int = 2, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def node(logs: Path) -> Iterator[SimNode]:
    # One sequence at a time; the replica keeps at most one request open on it (--max-connections 1).
    with SimNode(logs, "full-node", role="mixed", max_num_seqs=1, itl=0.01, output_len=1000) as sim:
        yield sim


@pytest.fixture(scope="module")
def other(logs: Path) -> Iterator[SimNode]:
    with SimNode(logs, "roomy-node", role="mixed", model=[OTHER], itl=0.002) as sim:
        yield sim


def replica(logs: Path, node: SimNode, other: SimNode, timeout: str, name: str) -> ProxyProc:
    proxy = ProxyProc(
        logs,
        "--mixed",
        node.host_port,
        other.host_port,
        "--max-connections",
        "1",
        "--queue-timeout",
        timeout,
        name=name,
    )
    proxy.wait_routable("mixed", node.host_port)
    proxy.wait_routable("mixed", other.host_port)
    return proxy


@pytest.fixture(scope="module")
def proxy(logs: Path, node: SimNode, other: SimNode) -> Iterator[ProxyProc]:
    started = replica(logs, node, other, "30", "queueing-proxy")
    try:
        yield started
    finally:
        started.stop()


class Holder:
    """A long stream (10 s) that keeps the node's one sequence busy until ``release`` ends it: its client leaves,
    so the replica cancels it on the node (however slowly the machine runs the test meanwhile)."""

    def __init__(self, proxy: ProxyProc, node: SimNode, request_id: str) -> None:
        self.request_id = request_id
        self._released = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(proxy,))
        self.thread.start()
        node.wait_for_request(request_id=request_id, state="running")

    def _run(self, proxy: ProxyProc) -> None:
        with httpx.stream(
            "POST",
            f"{proxy.url}/v1/chat/completions",
            json=chat(max_tokens=1000, stream=True),
            headers={"X-Request-Id": self.request_id},
            timeout=60,
        ) as answer:
            for _ in answer.iter_bytes():
                if self._released.is_set():
                    return

    def release(self) -> None:
        self._released.set()
        self.thread.join(30)


def send(proxy: ProxyProc, request_id: str, results: dict[str, int], **extra: object) -> threading.Thread:
    def run() -> None:
        answer = httpx.post(
            f"{proxy.url}/v1/chat/completions", json=chat(**extra), headers={"X-Request-Id": request_id}, timeout=60
        )
        results[request_id] = answer.status_code

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def depth(proxy: ProxyProc) -> float:
    return metric(proxy, "vllm_proxy_queue_depth", model=MODEL)


def test_a_priority_0_request_overtakes_queued_priority_1_requests(proxy: ProxyProc, node: SimNode) -> None:
    node.clear_requests()
    holder = Holder(proxy, node, "holder")
    results: dict[str, int] = {}
    threads = []
    for index, (request_id, priority) in enumerate((("low-1", 1), ("low-2", 1), ("low-3", 1), ("urgent", 0))):
        threads.append(send(proxy, request_id, results, priority=priority))
        wait_until(lambda n=index + 1: depth(proxy) == n, 10, f"{index + 1} requests queued")
    holder.release()
    for thread in threads:
        thread.join(30)
    assert results == {"low-1": 200, "low-2": 200, "low-3": 200, "urgent": 200}
    order = [r["request_id"] for r in node.requests()]
    assert order == ["holder", "urgent", "low-1", "low-2", "low-3"]
    assert [r["priority"] for r in node.requests()][1:] == [0, 1, 1, 1]  # the body's priority reached vLLM
    assert depth(proxy) == 0
    assert metric(proxy, "vllm_proxy_tenant_queue_wait_seconds_count", tenant="none") >= 4


def test_a_queued_client_that_disconnects_leaves_the_queue_and_never_reaches_the_node(
    proxy: ProxyProc, node: SimNode
) -> None:
    node.clear_requests()
    holder = Holder(proxy, node, "holder-2")
    body = b'{"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    abandoned = metric(proxy, "vllm_proxy_tenant_queue_abandoned_total", tenant="none")
    with socket.create_connection((HOST, proxy.port)) as client:
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: gone\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_until(lambda: depth(proxy) == 1, 10, "the request queued")
    wait_until(lambda: depth(proxy) == 0, 10, "the abandoned request left the queue")
    assert metric(proxy, "vllm_proxy_tenant_queue_abandoned_total", tenant="none") == abandoned + 1
    assert holder.thread.is_alive()  # it left while the node was still full
    holder.release()
    results: dict[str, int] = {}
    send(proxy, "after", results).join(30)
    assert results == {"after": 200}
    assert [r["request_id"] for r in node.requests()] == ["holder-2", "after"]


def test_a_model_whose_nodes_have_room_is_never_queued(proxy: ProxyProc, node: SimNode) -> None:
    holder = Holder(proxy, node, "holder-3")
    answer = proxy.post("/v1/chat/completions", json=chat(OTHER))
    assert answer.status_code == 200
    assert holder.thread.is_alive()  # answered while the other model's node was full
    assert metric(proxy, "vllm_proxy_queue_depth", model=OTHER) == 0
    holder.release()


def test_a_request_that_waits_longer_than_the_queue_timeout_gets_503_with_retry_after(
    logs: Path, node: SimNode, other: SimNode
) -> None:
    short = replica(logs, node, other, "0.5", "impatient-proxy")
    try:
        holder = Holder(short, node, "holder-4")
        answer = short.post("/v1/chat/completions", json=chat())
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "queue_timeout"
        assert metric(short, "vllm_proxy_tenant_rejections_total", tenant="none", limit="queue_timeout") == 1
        holder.release()
    finally:
        short.stop()


def test_a_node_whose_scraped_queue_is_at_the_threshold_is_full_until_a_scrape_shows_room(
    logs: Path, node: SimNode, other: SimNode
) -> None:
    watcher = ProxyProc(
        logs,
        "--mixed",
        node.host_port,
        other.host_port,
        "--queue-timeout",
        "20",
        "--queue-when-waiting",
        "1",
        "--scrape-load",
        "0.1",
        name="waiting-proxy",
    )
    try:
        watcher.wait_routable("mixed", node.host_port)

        def scraped_waiting() -> int:
            (worker,) = [w for w in watcher.workers() if w["id"] == node.host_port]
            return int((worker["node_load"] or {}).get("waiting", -1))

        holder = Holder(watcher, node, "holder-5")
        results: dict[str, int] = {}
        second = send(watcher, "second", results)  # the node's queue has room for one: it goes there
        node.wait_for_request(request_id="second", state="waiting")
        wait_until(lambda: scraped_waiting() == 1, 10, "a scrape that sees the node's queue")
        third = send(watcher, "third", results)  # now the node counts as full: it waits in the replica
        wait_until(lambda: metric(watcher, "vllm_proxy_queue_depth", model=MODEL) == 1, 10, "third queued")
        assert not any(r["request_id"] == "third" for r in node.requests())
        holder.release()
        for thread in (second, third):
            thread.join(30)
        assert results == {"second": 200, "third": 200}
        assert metric(watcher, "vllm_proxy_queue_depth", model=MODEL) == 0
    finally:
        watcher.stop()
