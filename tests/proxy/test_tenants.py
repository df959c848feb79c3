"""Keys that name a tenant and its limits, enforced by two replicas that share them through etcd."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.etcd_server import EtcdServer
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MODEL = "sim-model"
KEYS = """\
# tenant limits
rpm-key tenant=rpm-team rpm=4
tpm-key tenant=tpm-team tpm=200
conc-key tenant=conc-team concurrency=2
reload-key tenant=reload-team rpm=1000
not a valid=line
bare-key
"""


def chat(max_tokens: int = 4, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def metric(replica: ProxyProc, name: str, **labels: str) -> float:
    """The value of one sample of the replica's /metrics (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in replica.get("/metrics").text.splitlines():
        found = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if found and ",".join(sorted((found.group(1) or "").split(","))) == want:
            return float(found.group(2))
    return 0.0


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory, logs: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd"), logs)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def node(logs: Path) -> Iterator[SimNode]:
    with SimNode(logs, "tenant-node", role="mixed", itl=0.002, output_len=1000) as sim:
        yield sim


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def replicas(logs: Path, node: SimNode, etcd_server: EtcdServer, key_file: Path) -> Iterator[list[ProxyProc]]:
    started: list[ProxyProc] = []
    try:
        for name in ("replica-a", "replica-b"):
            started.append(
                ProxyProc(
                    logs,
                    "--etcd",
                    etcd_server.endpoint,
                    "--mixed",
                    node.host_port,
                    "--model",
                    MODEL,
                    "--api-key-file",
                    str(key_file),
                    name=name,
                )
            )
        for replica in started:
            replica.wait_routable("mixed", node.host_port)
            wait_until(lambda r=replica: metric(r, "vllm_proxy_limit_replicas") == 2, 15, "both replicas counted")
        yield started
    finally:
        for replica in started:
            replica.stop()


def until_admitted(replica: ProxyProc, key: str, wanted: int, timeout: float = 10.0) -> list[httpx.Response]:
    """Requests through ``replica`` until ``wanted`` of them were admitted (a 429 while the replica's share grows
    is retried a moment later); every answer, in order."""
    answers: list[httpx.Response] = []
    deadline = time.monotonic() + timeout
    while sum(a.status_code == 200 for a in answers) < wanted:
        assert time.monotonic() < deadline, [a.status_code for a in answers]
        answers.append(replica.post("/v1/chat/completions", json=chat(), headers=auth(key)))
        if answers[-1].status_code == 429:
            time.sleep(0.05)
    return answers


def test_a_key_over_its_rpm_gets_the_whole_limit_through_one_replica_then_openai_429(
    replicas: list[ProxyProc],
) -> None:
    # rpm=4 behind two replicas, every request through one of them (one kept-alive connection).
    a, b = replicas
    started = time.monotonic()
    answers = until_admitted(a, "rpm-key", 4)
    ok = [answer for answer in answers if answer.status_code == 200]
    assert ok[0].headers["x-ratelimit-limit-requests"] == "4"
    assert ok[0].headers["x-ratelimit-reset-requests"].endswith(("ms", "s"))
    assert ok[-1].headers["x-ratelimit-remaining-requests"] == "0"
    for replica in (a, b):  # the fleet's minute is spent, whichever replica asks
        refused = replica.post("/v1/chat/completions", json=chat(), headers=auth("rpm-key"))
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded" and error["param"] is None
        assert "requests per min (RPM): Limit 4" in error["message"] and "rpm-team" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert metric(replica, "vllm_proxy_tenant_rejections_total", tenant="rpm-team", limit="rpm") >= 1
    # The fleet admitted the key's limit, and no more than the minute's refill on top.
    admitted = sum(metric(r, "vllm_proxy_tenant_requests_total", tenant="rpm-team") for r in replicas)
    assert 4 <= admitted <= 4 + (time.monotonic() - started) * 4 / 60


def test_tokens_are_charged_from_the_nodes_usage_and_tpm_refuses_once_spent(replicas: list[ProxyProc]) -> None:
    replica = replicas[0]  # tpm=200: through one replica, the whole 200 (the other hands its part over)
    statuses, used, largest = [], 0, 0
    started = time.monotonic()
    while 429 not in statuses:
        assert len(statuses) < 20, statuses
        answer = replica.post(
            "/v1/chat/completions",
            headers=auth("tpm-key"),
            json=chat(30, stream=True, stream_options={"include_usage": True}),
        )
        statuses.append(answer.status_code)
        if answer.status_code == 200:
            usage = [
                json.loads(line[6:])
                for line in answer.text.splitlines()
                if line.startswith("data: {") and '"usage"' in line
            ][-1]["usage"]
            tokens = usage["prompt_tokens"] + usage["completion_tokens"]
            used, largest = used + tokens, max(largest, tokens)
        else:
            error = answer.json()["error"]
            assert error["type"] == "tokens" and "tokens per min (TPM): Limit 200" in error["message"]
            assert answer.headers["x-ratelimit-limit-tokens"] == "200"
            assert answer.headers["x-ratelimit-remaining-tokens"] == "0"
    refilled = (time.monotonic() - started) * 200 / 60
    assert statuses[0] == 200
    assert metric(replica, "vllm_proxy_tenant_tokens_total", tenant="tpm-team") == used
    # Admitted while the limit was not spent: as one replica holding it would, up to one request's tokens over.
    assert 200 - largest <= used <= 200 + largest + refilled


def test_a_key_at_its_concurrency_limit_gets_429_until_one_of_its_requests_ends(
    replicas: list[ProxyProc], node: SimNode
) -> None:
    a, b = replicas  # concurrency=2: both through a (b hands its slot over), none left for b
    node.configure(itl=0.02)  # streams of 8 s
    started = [threading.Event(), threading.Event()]
    results: list[int] = []

    def long_stream(started: threading.Event) -> None:
        with httpx.stream(
            "POST", f"{a.url}/v1/chat/completions", json=chat(400, stream=True), headers=auth("conc-key"), timeout=30
        ) as answer:
            for _ in answer.iter_lines():
                started.set()
            results.append(answer.status_code)

    threads = [threading.Thread(target=long_stream, args=(event,)) for event in started]
    for thread in threads:
        thread.start()
    try:
        assert all(event.wait(10) for event in started)
        for replica in (a, b):
            refused = replica.post("/v1/chat/completions", json=chat(), headers=auth("conc-key"))
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "concurrency"
            assert refused.headers["retry-after"] == "1"
    finally:
        for thread in threads:
            thread.join(30)
        node.configure(itl=0.002)
    assert results == [200, 200]
    for replica in (b, a):
        assert replica.post("/v1/chat/completions", json=chat(), headers=auth("conc-key")).status_code == 200


def test_bad_key_lines_are_skipped_and_counted_and_bare_keys_still_work(replicas: list[ProxyProc]) -> None:
    replica = replicas[0]
    assert metric(replica, "vllm_proxy_invalid_keys_total", source="file") == 1
    answer = replica.post("/v1/chat/completions", json=chat(), headers=auth("bare-key"))
    assert answer.status_code == 200 and "x-ratelimit-limit-requests" not in answer.headers
    assert replica.post("/v1/chat/completions", json=chat(), headers=auth("nope")).status_code == 401
    assert "bare-key" not in replica.proc.log() and "rpm-key" not in replica.proc.log()


def test_sighup_reloads_the_key_file_without_dropping_a_request_in_flight(
    replicas: list[ProxyProc], key_file: Path
) -> None:
    replica = replicas[1]
    results: list[tuple[int, str]] = []
    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream(
            "POST",
            f"{replica.url}/v1/chat/completions",
            json=chat(900, stream=True),
            headers=auth("reload-key"),
            timeout=30,
        ) as answer:
            lines = []
            for line in answer.iter_lines():
                streaming.set()
                if line:
                    lines.append(line)
            results.append((answer.status_code, lines[-1] if lines else ""))

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert streaming.wait(10)
        key_file.write_text(KEYS.replace("reload-key tenant=reload-team rpm=1000", "new-key tenant=new-team rpm=5"))
        reloads = metric(replica, "vllm_proxy_key_file_reloads_total", outcome="ok")
        os.kill(replica.proc.popen.pid, signal.SIGHUP)
        wait_until(
            lambda: metric(replica, "vllm_proxy_key_file_reloads_total", outcome="ok") == reloads + 1,
            10,
            "the key file reloaded",
        )
        assert replica.post("/v1/chat/completions", json=chat(), headers=auth("new-key")).status_code == 200
        assert replica.post("/v1/chat/completions", json=chat(), headers=auth("reload-key")).status_code == 401
        assert thread.is_alive(), "the stream should still be going"
    finally:
        thread.join(30)
    assert results == [(200, "data: [DONE]")]  # the request that started under the old key finished
    assert replica.proc.alive()


def test_a_key_put_in_etcd_applies_on_every_replica_without_a_restart(
    replicas: list[ProxyProc], etcd_server: EtcdServer
) -> None:
    digest = hashlib.sha256(b"etcd-key").hexdigest()
    key = f"/vllm/default/keys/{digest}"
    etcd_server.etcdctl("put", key, json.dumps({"tenant": "etcd-team", "rpm": 2}))
    etcd_server.etcdctl("put", "/vllm/default/keys/not-a-digest", "{}")
    for replica in replicas:
        wait_until(
            lambda r=replica: (
                r.post("/v1/chat/completions", json=chat(), headers=auth("etcd-key")).status_code in (200, 429)
            ),
            10,
            "the etcd key works",
        )
        assert metric(replica, "vllm_proxy_invalid_keys_total", source="etcd") >= 1
    # Its limit is the fleet's, however the requests fall on the replicas.
    refused = [r.post("/v1/chat/completions", json=chat(), headers=auth("etcd-key")) for r in replicas * 3]
    assert any("Limit 2" in answer.json()["error"]["message"] for answer in refused if answer.status_code == 429)
    assert 1 <= sum(metric(r, "vllm_proxy_tenant_requests_total", tenant="etcd-team") for r in replicas) <= 2
    # The limits change and the key goes while a request under it is in flight: that request finishes.
    results: list[int] = []
    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream(
            "POST",
            f"{replicas[1].url}/v1/chat/completions",
            json=chat(900, stream=True),
            headers=auth("etcd-key"),
            timeout=30,
        ) as answer:
            for _ in answer.iter_lines():
                streaming.set()
            results.append(answer.status_code)

    etcd_server.etcdctl("put", key, json.dumps({"tenant": "etcd-team", "concurrency": 4}))
    wait_until(
        lambda: replicas[1].post("/v1/chat/completions", json=chat(), headers=auth("etcd-key")).status_code == 200,
        10,
        "the new limit",
    )
    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(10)
    etcd_server.etcdctl("del", key)
    assert thread.is_alive(), f"the stream should still be going: {results}"
    for replica in replicas:
        wait_until(
            lambda r=replica: r.post("/v1/chat/completions", json=chat(), headers=auth("etcd-key")).status_code == 401,
            10,
            "the etcd key gone",
        )
    thread.join(30)
    assert results == [200]


def test_a_replica_that_joins_or_leaves_changes_every_replicas_share(
    replicas: list[ProxyProc], logs: Path, node: SimNode, etcd_server: EtcdServer
) -> None:
    third = ProxyProc(
        logs,
        "--etcd",
        etcd_server.endpoint,
        "--mixed",
        node.host_port,
        "--model",
        MODEL,
        "--api-key",
        "k",
        name="replica-c",
    )
    try:
        for replica in (*replicas, third):
            wait_until(lambda r=replica: metric(r, "vllm_proxy_limit_replicas") == 3, 15, "three replicas counted")
    finally:
        third.stop()
    # A replica that stops revokes its lease: the others count it out at once, not after the TTL.
    for replica in replicas:
        wait_until(lambda r=replica: metric(r, "vllm_proxy_limit_replicas") == 2, 5, "back to two replicas")
