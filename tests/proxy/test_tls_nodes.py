"""Nodes served over ``https://`` (vLLM's --ssl-* flags on the node), here one that also requires a client
certificate: the request path (our own transport), the control plane (models probe, load scrapes), the
WebSocket relay and cancellation all go over TLS with ``--node-ca-bundle`` and ``--node-cert``; without them
the node is never used, and the log says which flags to check."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.support.certs import CertAuthority, Issued
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertAuthority:
    assert shutil.which("openssl"), "openssl makes the test certificates (.ci/run installs it)"
    return CertAuthority(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def client_cert(ca: CertAuthority) -> Issued:
    return ca.issue("proxy-client", client=True)


@pytest.fixture(scope="module")
def node(logs: Path, ca: CertAuthority, client_cert: Issued) -> Iterator[SimNode]:
    served = ca.issue("https-node")
    sim = SimNode(
        logs,
        "https-node",
        role="mixed",
        ttft=0.001,
        itl=0.002,
        ssl_certfile=served.cert,
        ssl_keyfile=served.key,
        ssl_ca_certs=ca.pem,
        ssl_cert_reqs=2,
        tls=ca.client_context(client_cert),
    )
    with sim:
        yield sim


@pytest.fixture(scope="module")
def replica(logs: Path, ca: CertAuthority, client_cert: Issued, node: SimNode) -> Iterator[ProxyProc]:
    tls = ["--node-ca-bundle", ca.pem, "--node-cert", client_cert.cert, "--node-key", client_cert.key]
    proxy = ProxyProc(logs, "--mixed", node.url, *tls, "--scrape-load", "0.1", name="proxy-https-nodes")
    try:
        proxy.wait_routable("mixed", node.host_port)  # its models came from GET /v1/models, over TLS
        yield proxy
    finally:
        proxy.stop()


def worker(proxy: ProxyProc, node: SimNode) -> dict[str, Any]:
    return next(w for w in proxy.workers() if w["id"] == node.host_port)


def test_requests_and_streams_reach_an_https_node_that_requires_a_client_certificate(
    replica: ProxyProc, node: SimNode
) -> None:
    answer = replica.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "tls-plain"})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    with httpx.stream(
        "POST", f"{replica.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True}
    ) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert len(events) == 9 and events[-1] == "data: [DONE]"
    assert node.wait_for_request(request_id="tls-plain", state="done")["path"] == "/v1/chat/completions"
    assert worker(replica, node)["url"] == node.url


def test_the_load_scrape_reads_an_https_nodes_metrics(replica: ProxyProc, node: SimNode) -> None:
    wait_until(lambda: worker(replica, node)["node_load"] is not None, 10, "a load scrape of the https node")
    assert worker(replica, node)["node_load"]["age_seconds"] < 5


def test_a_client_that_walks_away_cancels_the_request_on_the_https_node(replica: ProxyProc, node: SimNode) -> None:
    node.configure(itl=0.2)
    try:
        body = {**CHAT, "max_tokens": 100, "stream": True}
        with httpx.stream(
            "POST", f"{replica.url}/v1/chat/completions", json=body, headers={"x-request-id": "tls-away"}, timeout=30
        ) as response:
            next(line for line in response.iter_lines() if line.startswith("data:"))
        seen = node.wait_for_request(timeout=5.0, request_id="tls-away", cancelled=True)
        assert seen["completion_tokens"] < 100
    finally:
        node.configure(itl=0.002)


async def test_a_websocket_session_is_relayed_to_an_https_node_over_wss(replica: ProxyProc, node: SimNode) -> None:
    url = replica.url.replace("http://", "ws://") + "/v1/realtime"
    async with connect(url, additional_headers={"x-request-id": "tls-wss"}) as ws:
        assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "session.created"
    await asyncio.to_thread(node.wait_for_request, 10.0, request_id="tls-wss", method="WEBSOCKET", state="closed")


def test_without_the_ca_bundle_the_node_is_never_used_and_the_log_names_the_flags(
    logs: Path, ca: CertAuthority, node: SimNode
) -> None:
    proxy = ProxyProc(logs, "--mixed", node.url, "--model", MODEL, name="proxy-untrusted-node")
    try:
        answer = proxy.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "tls-untrusted"})
        assert answer.status_code in (502, 503), answer.text
        assert "TLS failed" in proxy.proc.log() and "--node-ca-bundle" in proxy.proc.log()
        assert not [r for r in node.requests() if r["request_id"] == "tls-untrusted"]
    finally:
        proxy.stop()
