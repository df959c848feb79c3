"""TLS on the replica (vLLM's --ssl-* flags), seen by real TLS clients: the openai client with a CA bundle, SSE
and WebSockets over TLS, client certificates refused and accepted, a new certificate on SIGHUP seen by new
connections while an open stream goes on, a bad one refused with the old one kept, and ``--workers``."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from websockets.asyncio.client import connect

from tests.support.certs import CertAuthority, Issued
from tests.support.procs import HOST, wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MODEL = "sim-model"
STREAM_TOKENS = 400
AUDIO = base64.b64encode(bytes(range(256)) * 4).decode()


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertAuthority:
    assert shutil.which("openssl"), "openssl makes the test certificates (.ci/run installs it)"
    return CertAuthority(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def node(logs: Path) -> Iterator[SimNode]:
    with SimNode(logs, "tls-node", role="mixed", ttft=0.001, itl=0.002) as sim:
        yield sim


@pytest.fixture(scope="module")
def replica(logs: Path, ca: CertAuthority, node: SimNode) -> Iterator[ProxyProc]:
    served = ca.issue("replica")
    tls = ["--ssl-certfile", served.cert, "--ssl-keyfile", served.key]
    proxy = ProxyProc(logs, "--mixed", node.host_port, *tls, name="proxy-tls", tls=ca.client_context())
    try:
        proxy.wait_routable("mixed", node.host_port)
        yield proxy
    finally:
        proxy.stop()


class CertFiles:
    """The files a replica was started with, rewritten in place as an operator's renewal would."""

    def __init__(self, folder: Path, first: Issued) -> None:
        folder.mkdir(exist_ok=True)
        self.cert, self.key = str(folder / "served.pem"), str(folder / "served.key")
        self.put(first)

    def put(self, issued: Issued) -> None:
        shutil.copyfile(issued.cert, self.cert)
        shutil.copyfile(issued.key, self.key)

    def flags(self) -> list[str]:
        return ["--ssl-certfile", self.cert, "--ssl-keyfile", self.key]


def served_certificate(port: int, context: ssl.SSLContext) -> bytes:
    """The certificate a new connection to the replica is shown."""
    with (
        socket.create_connection((HOST, port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=HOST) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def listeners(port: int) -> int:
    """Sockets listening on ``port`` on 127.0.0.1 (the kernel's table: state 0A is LISTEN)."""
    wanted = f"0100007F:{port:04X}"
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for row in rows if row.split()[1] == wanted and row.split()[3] == "0A")


def metric(proxy: ProxyProc, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in proxy.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def chat(tokens: int = 4, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, **extra}


def test_the_openai_client_with_the_ca_bundle_gets_answers_and_streams_over_tls(
    replica: ProxyProc, ca: CertAuthority
) -> None:
    with httpx.Client(verify=ca.client_context()) as http:
        client = openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", http_client=http)
        assert [m.id for m in client.models.list()] == [MODEL]
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert answer.choices[0].message.content
        stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=12, stream=True)
        pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
        assert len(pieces) == 12 and all(pieces)


def test_a_client_that_does_not_trust_the_certificate_or_speaks_plain_http_gets_nothing(replica: ProxyProc) -> None:
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{replica.url}/health", verify=ssl.create_default_context(), timeout=5)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{HOST}:{replica.port}/health", timeout=5)


async def test_a_websocket_session_runs_over_tls(replica: ProxyProc, ca: CertAuthority, node: SimNode) -> None:
    url = replica.url.replace("https://", "wss://") + "/v1/realtime"
    async with connect(url, ssl=ca.client_context(), additional_headers={"x-request-id": "tls-ws"}) as ws:
        assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "session.created"
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": AUDIO}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        while (event := json.loads(await asyncio.wait_for(ws.recv(), 10)))["type"] == "transcription.delta":
            pass
        assert event["type"] == "transcription.done" and event["text"]
    await asyncio.to_thread(node.wait_for_request, 10.0, request_id="tls-ws", method="WEBSOCKET", state="closed")


def test_a_required_client_certificate_is_refused_when_missing_or_foreign_and_accepted_when_signed(
    logs: Path, ca: CertAuthority, node: SimNode, tmp_path: Path
) -> None:
    served, client = ca.issue("mtls-replica"), ca.issue("mtls-client", client=True)
    stranger_ca = CertAuthority(tmp_path / "stranger", name="stranger-ca")
    stranger = stranger_ca.issue("stranger", client=True)
    flags = ["--ssl-certfile", served.cert, "--ssl-keyfile", served.key, "--ssl-ca-certs", ca.pem]
    proxy = ProxyProc(
        logs,
        "--mixed",
        node.host_port,
        *flags,
        "--ssl-cert-reqs",
        "2",
        name="proxy-mtls",
        tls=ca.client_context(client),
    )
    try:
        for context in (ca.client_context(), ca.client_context(stranger)):
            # TLS 1.3: the server's refusal arrives with the first read, after the client's handshake ended.
            with pytest.raises(httpx.HTTPError):
                httpx.post(f"{proxy.url}/v1/chat/completions", json=chat(), verify=context, timeout=5)
        answer = httpx.post(f"{proxy.url}/v1/chat/completions", json=chat(), verify=ca.client_context(client))
        assert answer.status_code == 200 and answer.json()["choices"]
    finally:
        proxy.stop()


def test_sighup_gives_new_connections_the_new_certificate_while_an_open_stream_goes_on(
    logs: Path, ca: CertAuthority, node: SimNode, tmp_path: Path
) -> None:
    first, second = ca.issue("reload-first"), ca.issue("reload-second")
    files = CertFiles(tmp_path / "served", first)
    context = ca.client_context()
    proxy = ProxyProc(logs, "--mixed", node.host_port, *files.flags(), name="proxy-reload", tls=context)
    results: list[tuple[int, list[str]]] = []
    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream(
            "POST",
            f"{proxy.url}/v1/chat/completions",
            json=chat(STREAM_TOKENS, stream=True, ignore_eos=True),
            verify=context,
            timeout=60,
        ) as answer:
            lines = []
            for line in answer.iter_lines():
                streaming.set()
                if line:
                    lines.append(line)
            results.append((answer.status_code, lines))

    thread = threading.Thread(target=stream)
    try:
        proxy.wait_routable("mixed", node.host_port)
        assert served_certificate(proxy.port, context) == first.der
        node.configure(itl=0.05)  # the stream lasts (20 s at most) until the reload has been seen
        thread.start()
        assert streaming.wait(10)
        files.put(second)
        os.kill(proxy.proc.pid, signal.SIGHUP)
        wait_until(lambda: served_certificate(proxy.port, context) == second.der, 10, "the new certificate served")
        assert metric(proxy, "vllm_proxy_tls_reloads_total", outcome="ok") == 1
        assert thread.is_alive(), "the stream that began under the old certificate should still be going"
        assert proxy.post("/v1/chat/completions", json=chat()).status_code == 200
    finally:
        node.configure(itl=0.002)
        thread.join(30)
        proxy.stop()
    ((status, lines),) = results
    assert status == 200 and lines[-1] == "data: [DONE]" and len(lines) > STREAM_TOKENS
    assert not any('"error"' in line for line in lines)


def test_a_bad_certificate_on_sighup_is_logged_and_the_old_one_kept(
    logs: Path, ca: CertAuthority, node: SimNode, tmp_path: Path
) -> None:
    first, other, renewed = ca.issue("bad-first"), ca.issue("bad-other"), ca.issue("bad-renewed")
    files = CertFiles(tmp_path / "served", first)
    context = ca.client_context()
    proxy = ProxyProc(logs, "--mixed", node.host_port, *files.flags(), name="proxy-bad-reload", tls=context)
    try:
        # A renewal caught half-way: the new certificate is in place, its key is still the old one.
        shutil.copyfile(other.cert, files.cert)
        os.kill(proxy.proc.pid, signal.SIGHUP)
        wait_until(lambda: metric(proxy, "vllm_proxy_tls_reloads_total", outcome="failed") == 1, 10, "a failed reload")
        assert "TLS certificate not reloaded" in proxy.proc.log()
        assert served_certificate(proxy.port, context) == first.der
        assert proxy.post("/v1/chat/completions", json=chat()).status_code == 200
        # Once the renewal is whole, the next SIGHUP takes it.
        files.put(renewed)
        os.kill(proxy.proc.pid, signal.SIGHUP)
        wait_until(lambda: served_certificate(proxy.port, context) == renewed.der, 10, "the renewed certificate")
        assert proxy.proc.alive()
        key_text = Path(renewed.key).read_text()
        assert key_text.splitlines()[1] not in proxy.proc.log()
    finally:
        proxy.stop()


def test_every_worker_serves_tls_and_reloads_on_the_parents_sighup(
    logs: Path, ca: CertAuthority, node: SimNode, tmp_path: Path
) -> None:
    first, second = ca.issue("workers-first"), ca.issue("workers-second")
    files = CertFiles(tmp_path / "served", first)
    context = ca.client_context()
    proxy = ProxyProc(
        logs, "--mixed", node.host_port, *files.flags(), "--workers", "2", name="proxy-tls-workers", tls=context
    )

    try:
        # A worker listens once it is ready (workers.py): two listening sockets on the port are both workers ready.
        wait_until(lambda: listeners(proxy.port) == 2, 20, "both workers listening")
        assert all(served_certificate(proxy.port, context) == first.der for _ in range(10))
        files.put(second)
        os.kill(proxy.proc.pid, signal.SIGHUP)
        # The kernel spreads new connections over both workers: 20 in a row with the new certificate is what a
        # worker that kept the old one would make all but impossible (2^-20).
        wait_until(
            lambda: all(served_certificate(proxy.port, context) == second.der for _ in range(20)),
            15,
            "every worker serving the new certificate",
        )
        for _ in range(6):
            with httpx.Client(verify=context, timeout=10) as client:
                assert client.post(f"{proxy.url}/v1/chat/completions", json=chat()).status_code == 200
    finally:
        proxy.stop()
