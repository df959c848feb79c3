"""Tenant limits behind an L4 balancer: each tenant's limits split among the replicas by where its requests
really go (real etcd, two and three replicas, a simulated node). A client whose traffic all lands on one
replica gets its whole limit there; one that moves keeps getting it and the fleet no more."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.etcd_server import EtcdServer
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode
from tests.support.streams import HeldStream

MODEL = "sim-model"
KEYS = """\
one-key tenant=one rpm=30
move-key tenant=move rpm=60
three-key tenant=three rpm=60
tokens-key tenant=tokens tpm=1000
conc-key tenant=conc concurrency=3
hold-key tenant=hold rpm=60
first-key tenant=first rpm=6
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


def share(replica: ProxyProc, tenant: str, limit: str = "rpm") -> float:
    return metric(replica, "vllm_proxy_tenant_limit_share", tenant=tenant, limit=limit)


def admitted(replicas: list[ProxyProc], tenant: str) -> float:
    return sum(metric(r, "vllm_proxy_tenant_requests_total", tenant=tenant) for r in replicas)


class Client:
    """One client on one kept-alive connection to one replica, as an L4 balancer leaves it."""

    def __init__(self, replica: ProxyProc, key: str) -> None:
        self.http = httpx.Client(base_url=replica.url, headers=auth(key), timeout=30)

    def ask(self, **body: object) -> httpx.Response:
        return self.http.post("/v1/chat/completions", json=chat(**body))  # type: ignore[arg-type]

    def until_admitted(self, wanted: int, timeout: float, **body: object) -> int:
        """Requests until ``wanted`` were admitted (a refused one is asked again a moment later), or until
        ``timeout``; how many were admitted."""
        got, deadline = 0, time.monotonic() + timeout
        while got < wanted and time.monotonic() < deadline:
            answer = self.ask(**body)
            if answer.status_code == 200:
                got += 1
            else:
                assert answer.status_code == 429, answer.text
                time.sleep(0.05)
        return got

    def close(self) -> None:
        self.http.close()


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
    with SimNode(logs, "shares-node", role="mixed", itl=0.005, output_len=4000) as sim:
        yield sim


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEYS)
    return path


def start_replica(logs: Path, etcd_server: EtcdServer, node: SimNode, key_file: Path, name: str) -> ProxyProc:
    flags = ("--etcd", etcd_server.endpoint, "--mixed", node.host_port, "--model", MODEL)
    replica = ProxyProc(logs, *flags, "--api-key-file", str(key_file), name=name)
    try:
        replica.wait_routable("mixed", node.host_port)
    except BaseException:
        replica.stop()
        raise
    return replica


@pytest.fixture(scope="module")
def replicas(logs: Path, node: SimNode, etcd_server: EtcdServer, key_file: Path) -> Iterator[list[ProxyProc]]:
    started: list[ProxyProc] = []
    try:
        for name in ("replica-a", "replica-b"):
            started.append(start_replica(logs, etcd_server, node, key_file, name))
        for replica in started:
            wait_until(lambda r=replica: metric(r, "vllm_proxy_limit_replicas") == 2, 15, "both replicas counted")
        yield started
    finally:
        for replica in started:
            replica.stop()


def test_one_connection_through_one_replica_gets_the_whole_rpm(replicas: list[ProxyProc]) -> None:
    a, b = replicas
    client = Client(a, "one-key")
    started = time.monotonic()
    try:
        # rpm=30 behind two replicas: a single replica holding the whole limit would admit 30 at once.
        assert client.until_admitted(30, timeout=10) == 30
        assert client.ask().status_code == 429
    finally:
        client.close()
    assert 30 <= admitted(replicas, "one") <= 30 + (time.monotonic() - started) * 30 / 60 + 1
    assert share(a, "one") == pytest.approx(30) and share(b, "one") < 1
    assert metric(a, "vllm_proxy_tenant_fleet_demand", tenant="one", limit="rpm") > 30
    status = a.status()["replicas"]
    assert status["count"] == 2 and status["me"] in status["seen"] and status["shares"] == "fresh"


def test_a_new_tenants_first_burst_through_one_replica_of_two_gets_the_whole_rpm(replicas: list[ProxyProc]) -> None:
    a, b = replicas
    client = Client(b, "first-key")
    started = time.monotonic()
    try:
        statuses = [client.ask().status_code for _ in range(8)]
    finally:
        client.close()
    # rpm=6, nothing asked before: b holds 3 and is handed a's 3 while its fourth request waits; the seventh is 429.
    assert statuses == [200] * 6 + [429] * 2
    assert admitted(replicas, "first") <= 6 + (time.monotonic() - started) * 6 / 60 + 1


def test_one_connection_through_one_replica_gets_the_whole_tpm(replicas: list[ProxyProc]) -> None:
    a, _ = replicas
    client = Client(a, "tokens-key")
    spent, started = 0, time.monotonic()
    try:
        deadline = started + 10
        while spent < 900 and time.monotonic() < deadline:  # 90% of tpm=1000, each request about 60 tokens
            answer = client.ask(max_tokens=50)
            if answer.status_code == 200:
                usage = answer.json()["usage"]
                spent += usage["prompt_tokens"] + usage["completion_tokens"]
            else:
                time.sleep(0.05)
    finally:
        client.close()
    refilled = (time.monotonic() - started) * 1000 / 60
    assert 900 <= spent <= 1000 + refilled + 60  # tpm may overshoot by a request in flight
    assert share(a, "tokens", "tpm") == pytest.approx(1000)


def test_a_client_that_moves_to_another_replica_keeps_getting_its_rpm_and_the_fleet_no_more(
    replicas: list[ProxyProc],
) -> None:
    a, b = replicas
    started = time.monotonic()
    first = Client(a, "move-key")
    try:
        assert first.until_admitted(60, timeout=10) == 60  # the whole minute through a
    finally:
        first.close()
    moved = Client(b, "move-key")  # the connection breaks; the balancer puts the new one on b
    try:
        # The minute is spent: b gets the refill (one a second), as one replica holding the limit would.
        assert moved.until_admitted(3, timeout=20) == 3
    finally:
        moved.close()
    elapsed = time.monotonic() - started
    assert admitted(replicas, "move") <= 60 + elapsed * 60 / 60 + 2
    wait_until(lambda: share(b, "move") > share(a, "move"), 15, "the share followed the client to b")


def test_one_connection_through_one_replica_gets_the_whole_concurrency_and_the_fleet_no_more(
    replicas: list[ProxyProc],
) -> None:
    a, b = replicas
    streams: list[HeldStream] = []
    try:
        deadline = time.monotonic() + 15
        while sum(s.status == 200 for s in streams) < 3:  # concurrency=3, all through a
            assert time.monotonic() < deadline, [s.status for s in streams]
            streams.append(HeldStream(a.url, "conc-key"))
            assert streams[-1].answered.wait(30)
            if streams[-1].status == 429:
                streams.pop().release()
                time.sleep(0.1)
        extra = HeldStream(a.url, "conc-key")
        assert extra.answered.wait(30) and extra.status == 429
        extra.release()
        # a holds all three slots now: the fleet never runs more than the limit.
        on_b = [HeldStream(b.url, "conc-key") for _ in range(2)]
        for stream in on_b:
            assert stream.answered.wait(30)
        streams += on_b
        assert [s.status for s in on_b] == [429, 429]
        assert sum(s.status == 200 for s in streams) == 3
    finally:
        for stream in streams:
            stream.release()


def test_three_replicas_share_one_limit_by_demand_and_a_dead_ones_part_goes_to_a_live_one(
    replicas: list[ProxyProc], logs: Path, node: SimNode, etcd_server: EtcdServer, key_file: Path
) -> None:
    a, b = replicas
    c = start_replica(logs, etcd_server, node, key_file, "replica-c")
    try:
        for replica in (a, b, c):
            wait_until(lambda r=replica: metric(r, "vllm_proxy_limit_replicas") == 3, 15, "three replicas counted")
        started = time.monotonic()
        # 90 / 10 through c and a; b sees nothing of the tenant.
        heavy, light = Client(c, "three-key"), Client(a, "three-key")
        try:
            deadline = started + 20
            while time.monotonic() < deadline:  # until a whole round is refused: the minute is spent
                statuses = [heavy.ask().status_code for _ in range(9)] + [light.ask().status_code]
                if set(statuses) == {429}:
                    break
        finally:
            heavy.close()
            light.close()
        elapsed = time.monotonic() - started
        total = admitted([a, b, c], "three")
        assert 59 <= total <= 60 + elapsed * 60 / 60 + 1  # the fleet's limit, and no more
        assert share(b, "three") < 1, "b, never asked, handed its part over"
        c.proc.kill()  # dead: its lease expires within the TTL (10 s); what it held goes to a live replica
        wait_until(lambda: metric(a, "vllm_proxy_limit_replicas") == 2, 20, "c's key expired")
        wait_until(lambda: share(a, "three") + share(b, "three") > 59, 10, "a or b took what c held")
    finally:
        c.stop()


def test_etcd_down_keeps_the_last_shares_then_decays_to_the_even_split(
    replicas: list[ProxyProc], etcd_server: EtcdServer
) -> None:
    a, b = replicas
    client = Client(a, "hold-key")
    try:
        assert client.until_admitted(60, timeout=10) == 60
        wait_until(lambda: share(a, "hold") == 60, 10, "a holds the whole share")
        etcd_server.kill()
        try:
            assert share(a, "hold") > 30, "the share a last computed, at first"
            wait_until(lambda: share(a, "hold") == 30, 20, "a's share decayed to limit / R")
            assert a.status()["replicas"]["shares"] == "decaying"
            assert client.ask().status_code in (200, 429)  # still serving
        finally:
            etcd_server.start()
        wait_until(lambda: a.status()["replicas"]["shares"] == "fresh", 30, "etcd back")
        # Back to what the records say: the tenant's demand is on a (or, faded away, an even split).
        wait_until(lambda: share(a, "hold") >= 30, 15, "shares from the records again")
    finally:
        client.close()
