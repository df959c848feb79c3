"""Closed by default: client keys, the backend key, admin restrictions, limits, hostile input."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.procs import HOST
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def node(logs: Path) -> Iterator[SimNode]:
    with SimNode(logs, "locked-node", role="mixed", api_key="node-secret", itl=0.2) as sim:
        yield sim


@pytest.fixture(scope="module")
def proxy(logs: Path, node: SimNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# team b\nclient-key-b\n")
    replica = ProxyProc(
        logs,
        "--mixed",
        node.host_port,
        "--api-key",
        "client-key-a",
        "--api-key-file",
        str(key_file),
        "--backend-api-key",
        "node-secret",
        "--max-concurrent-requests",
        "2",
        "--max-body-bytes",
        "10000",
        "--body-timeout",
        "1",
        "--admin-allow-cidr",
        "127.0.0.0/8",
        admin_key="adm",
    )
    try:
        replica.wait_routable("mixed", node.host_port)
        yield replica
    finally:
        replica.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_client_key_is_required_on_every_openai_route(proxy: ProxyProc) -> None:
    routes = [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"model": MODEL, "prompt": "x"}),
        ("/v1/embeddings", {"model": MODEL, "input": "x"}),
        ("/tokenize", {"model": MODEL}),
    ]
    for path, body in routes:
        for headers in ({}, auth("wrong"), {"Authorization": "client-key-a"}):
            answer = proxy.post(path, json=body, headers=headers)
            assert answer.status_code == 401, (path, headers)
            assert answer.json()["error"]["type"] == "authentication_error"
    assert proxy.get("/v1/models").status_code == 401


def test_valid_client_keys_from_flag_and_file_work_and_the_node_gets_the_backend_key(
    proxy: ProxyProc, node: SimNode
) -> None:
    node.clear_requests()
    for key in ("client-key-a", "client-key-b"):
        answer = proxy.post("/v1/chat/completions", json=CHAT, headers=auth(key))
        assert answer.status_code == 200, answer.text
    assert {r["authorization"] for r in node.requests()} == {"Bearer node-secret"}
    assert proxy.get("/v1/models", headers=auth("client-key-a")).json()["data"][0]["id"] == MODEL


def test_health_metrics_status_stay_open_and_reveal_no_secret(proxy: ProxyProc) -> None:
    for path in ("/health", "/ready", "/metrics", "/status", "/list_workers", "/list_models"):
        answer = proxy.get(path)
        assert answer.status_code == 200, path
        for secret in ("client-key-a", "client-key-b", "node-secret", "adm"):
            assert f'"{secret}"' not in answer.text and f"Bearer {secret}" not in answer.text


def test_body_over_the_limit_is_a_413(proxy: ProxyProc) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 20000}]}
    answer = proxy.post("/v1/chat/completions", json=big, headers=auth("client-key-a"))
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "payload_too_large"


def test_a_64_mib_body_gets_a_readable_413_not_a_connection_reset(proxy: ProxyProc) -> None:
    # The body is far past the limit, and the client sends all of it before it reads: the replica must read on
    # (and drop) what comes, or the client's kernel sees a reset before the answer.
    body = b'{"model": "sim-model", "prompt": "' + b"x" * (64 * 1024 * 1024) + b'"}'
    headers = {"Content-Type": "application/json", **auth("client-key-a")}
    request = urllib.request.Request(f"{proxy.url}/v1/completions", data=body, headers=headers, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 413
    assert json.loads(refused.value.read())["error"]["code"] == "payload_too_large"
    answer = httpx.post(f"{proxy.url}/v1/completions", content=body, headers=headers, timeout=60)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "payload_too_large"


def test_a_client_sending_its_body_byte_by_byte_is_cut_off(proxy: ProxyProc) -> None:
    with socket.create_connection((HOST, proxy.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer client-key-a\r\n"
            b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"
        )
        started = time.monotonic()
        reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert time.monotonic() - started < 5


def test_requests_beyond_the_concurrency_limit_get_503_with_retry_after(proxy: ProxyProc, node: SimNode) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30, headers=auth("client-key-a")) as client:
            body = {**CHAT, "max_tokens": 10}
            slow = [asyncio.create_task(client.post(f"{proxy.url}/v1/chat/completions", json=body)) for _ in range(2)]
            async with asyncio.timeout(10):  # until both slow requests are generating on the node (~2 s each)
                while (await asyncio.to_thread(node.snapshot))["running"] < 2:
                    await asyncio.sleep(0.02)
            extra = await client.post(f"{proxy.url}/v1/chat/completions", json=CHAT)
            return [extra, *await asyncio.gather(*slow)]

    extra, *slow = asyncio.run(run())
    assert [r.status_code for r in slow] == [200, 200]
    assert extra.status_code == 503 and extra.headers["retry-after"] == "1"


@pytest.mark.parametrize(
    "instance",
    [
        "http://127.0.0.1:8000",
        "127.0.0.1:8000/path",
        "user@127.0.0.1:80",
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:70000",
        "[::1]",
        "a b:80",
        "",
    ],
)
def test_admin_add_refuses_anything_but_host_port(proxy: ProxyProc, instance: str) -> None:
    answer = proxy.post("/instances/add", json={"type": "decode", "instance": instance}, headers={"X-Api-Key": "adm"})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "instance"


def test_admin_add_outside_the_allowed_networks_is_forbidden(proxy: ProxyProc) -> None:
    # The address is only parsed: refused before the node is added, so nothing ever contacts it.
    answer = proxy.post(
        "/instances/add", json={"type": "decode", "instance": "10.1.2.3:8000"}, headers={"X-Api-Key": "adm"}
    )
    assert answer.status_code == 403
    assert "10.1.2.3:8000" not in proxy.status()["decode_nodes"]


def test_admin_key_is_not_a_client_key(proxy: ProxyProc) -> None:
    assert proxy.post("/v1/chat/completions", json=CHAT, headers=auth("adm")).status_code == 401
    assert (
        proxy.post(
            "/instances/add", json={"type": "decode", "instance": "127.0.0.1:9"}, headers=auth("client-key-a")
        ).status_code
        == 401
    )


def test_oversized_headers_get_a_431_and_the_replica_keeps_serving(proxy: ProxyProc) -> None:
    with socket.create_connection((HOST, proxy.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 431")
    assert proxy.get("/health").status_code == 200
