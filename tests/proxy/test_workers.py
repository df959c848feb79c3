"""``--workers 2``: two processes serve the port, /metrics counts every request whichever worker answers it, a
worker that dies is replaced, and SIGTERM drains them all."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MODEL = "sim-model"
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def node(logs: Path) -> Iterator[SimNode]:
    with SimNode(logs, "workers-node", role="mixed", ttft=0.001, itl=0.001) as sim:
        yield sim


@pytest.fixture()
def replica(logs: Path, node: SimNode) -> Iterator[ProxyProc]:
    proxy = ProxyProc(logs, "--mixed", node.host_port, "--workers", "2", name="proxy-workers")
    try:
        yield proxy
    finally:
        proxy.stop()


def _children(pid: int) -> set[int]:
    """The worker processes of the replica whose parent is ``pid`` (not multiprocessing's resource tracker)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(child) for child in (task / "children").read_text().split())
    workers = set()
    for child in found:
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                workers.add(child)
        except OSError:
            continue  # exited meanwhile
    return workers


def _requests_total(metrics: str) -> float:
    return sum(
        float(m)
        for m in re.findall(r'^vllm_proxy_requests_total\{[^}]*status="200"[^}]*\} (\S+)$', metrics, re.MULTILINE)
    )


def _fresh(url: str, path: str) -> httpx.Response:
    # A new connection each time, so the kernel may hand it to either worker.
    with httpx.Client(timeout=10) as client:
        return client.get(url + path)


def test_two_workers_share_the_load_and_metrics_count_every_request(replica: ProxyProc, node: SimNode) -> None:
    wait_until(lambda: all(_fresh(replica.url, "/ready").status_code == 200 for _ in range(8)), 20, "workers ready")
    for _ in range(40):
        with httpx.Client(timeout=10) as client:
            assert client.post(f"{replica.url}/v1/completions", json=BODY).status_code == 200
    # Each worker keeps its own pool, so /list_workers tells which one answered: both served some requests.
    served = set()
    for _ in range(30):
        workers = _fresh(replica.url, "/list_workers").json()["workers"]
        served.add(workers[0]["served"])
    # Two workers that served a and b requests show {a, b} with a + b = 40 ({20} when equal); one idle worker
    # would show 0.
    assert 0 not in served and (sum(served) == 40 or served == {20}), served
    # Whichever worker answers the scrape, the counters are the sum over both.
    for _ in range(6):
        assert _requests_total(_fresh(replica.url, "/metrics").text) == 40


def test_a_worker_that_dies_is_replaced_and_the_port_keeps_serving(replica: ProxyProc) -> None:
    wait_until(lambda: len(_children(replica.proc.popen.pid)) == 2, 20, "two workers")
    first = _children(replica.proc.popen.pid)
    victim = min(first)
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: victim not in _children(replica.proc.popen.pid) and len(_children(replica.proc.popen.pid)) == 2,
        20,
        "a new worker in place of the killed one",
    )
    wait_until(lambda: all(_fresh(replica.url, "/ready").status_code == 200 for _ in range(8)), 20, "ready again")
    for _ in range(10):
        with httpx.Client(timeout=10) as client:
            assert client.post(f"{replica.url}/v1/completions", json=BODY).status_code == 200


def test_sigterm_drains_every_worker_and_exits_zero(replica: ProxyProc) -> None:
    wait_until(lambda: len(_children(replica.proc.popen.pid)) == 2, 20, "two workers")
    workers = _children(replica.proc.popen.pid)
    replica.proc.popen.terminate()
    assert replica.proc.popen.wait(30) == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
