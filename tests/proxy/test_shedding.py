"""Refusals that need no body come before the body is read: a replica at ``--max-concurrent-requests``, or a
tenant over its rate, answers as soon as the headers are in, while the client is still sending (real replica and
simulated node, a raw socket for the client that sends a 10 MB body slowly)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.procs import HOST
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MODEL = "sim-model"
BODY_BYTES = 10 * 1024 * 1024


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def node(logs: Path) -> Iterator[SimNode]:
    with SimNode(logs, "shed-node", role="mixed", itl=0.02, output_len=400) as sim:
        yield sim


@pytest.fixture(scope="module")
def replica(logs: Path, node: SimNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("once-key tenant=once rpm=1\nrefund-key tenant=refund rpm=1\nfree-key tenant=free\n")
    flags = ("--mixed", node.host_port, "--model", MODEL, "--max-concurrent-requests", "1")
    proxy = ProxyProc(logs, *flags, "--api-key-file", str(keys), "--max-body-bytes", str(2 * BODY_BYTES))
    try:
        proxy.wait_routable("mixed", node.host_port)
        yield proxy
    finally:
        proxy.stop()


def answer_before_the_body(replica: ProxyProc, key: str) -> bytes:
    """The head of what the replica answers a request declaring a 10 MB body, of which only the first 64 KB are
    sent; b"" when it answered nothing within 10 s (it waits for the rest of the body)."""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {BODY_BYTES}\r\n\r\n"
    ).encode()
    with socket.create_connection((HOST, replica.port), timeout=10) as conn:
        conn.sendall(head + b'{"model": "sim-model", "messages": [{"role": "user", "content": "' + b"x" * 65536)
        try:
            return conn.recv(4096)
        except TimeoutError:
            return b""


def test_a_replica_at_its_concurrency_limit_refuses_a_10mb_body_before_reading_it(replica: ProxyProc) -> None:
    started = threading.Event()

    def hold_the_slot() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}
        auth = {"Authorization": "Bearer free-key"}
        with httpx.stream("POST", f"{replica.url}/v1/chat/completions", json=body, headers=auth, timeout=30) as answer:
            for _ in answer.iter_raw():
                started.set()

    holder = threading.Thread(target=hold_the_slot)
    holder.start()
    try:
        assert started.wait(10)
        began = time.monotonic()
        answer = answer_before_the_body(replica, "free-key")
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert time.monotonic() - began < 5
    finally:
        holder.join(30)
    # The slot is free again: a request goes through.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ok = replica.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer free-key"})
    assert ok.status_code == 200


def test_a_tenant_over_its_rpm_is_refused_before_its_10mb_body_is_read(replica: ProxyProc) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (
        replica.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer once-key"}).status_code == 200
    )
    answer = answer_before_the_body(replica, "once-key")
    assert answer.startswith(b"HTTP/1.1 429") and b"requests per min" in answer, answer[:300]


def test_a_request_refused_for_its_model_gives_its_request_of_the_rpm_limit_back(replica: ProxyProc) -> None:
    auth = {"Authorization": "Bearer refund-key"}  # rpm=1
    unknown = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):
        assert replica.post("/v1/chat/completions", json=unknown, headers=auth).status_code == 404
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert replica.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
    assert replica.post("/v1/chat/completions", json=body, headers=auth).status_code == 429
