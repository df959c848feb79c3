"""The lower bound of a tenant's limits behind an L4 balancer: however its requests fall across the replicas, the
fleet admits what one replica holding the whole limit would (within one request), and no more when bursts start
at every replica at once. Real etcd, three replicas, one simulated node; every case a tenant of its own that
nothing asked before, its requests sent one after another (a held request answers before the next is sent)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
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
one-key tenant=one rpm=9
split-key tenant=split rpm=10
pause-key tenant=pause rpm=10
move-key tenant=move rpm=10
burst-key tenant=burst rpm=6
all-key tenant=all rpm=12
tpm-pause-key tenant=tpm-pause tpm=600
tpm-all-key tenant=tpm-all tpm=600
conc-burst-key tenant=conc-burst concurrency=4
conc-move-key tenant=conc-move concurrency=4
conc-all-key tenant=conc-all concurrency=6
"""


def chat(max_tokens: int = 4, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}


class Clients:
    """One kept-alive connection per replica for one key, as an L4 balancer leaves a client's connections."""

    def __init__(self, replicas: list[ProxyProc], key: str) -> None:
        auth = {"Authorization": f"Bearer {key}"}
        self.http = [httpx.Client(base_url=r.url, headers=auth, timeout=30) for r in replicas]
        self.admitted = 0
        self.tokens = 0

    def ask(self, replica: int, **body: object) -> int:
        answer = self.http[replica].post("/v1/chat/completions", json=chat(**body))  # type: ignore[arg-type]
        assert answer.status_code in (200, 429), answer.text
        if answer.status_code == 200:
            self.admitted += 1
            usage = answer.json()["usage"]
            self.tokens += usage["prompt_tokens"] + usage["completion_tokens"]
        return answer.status_code

    def close(self) -> None:
        for client in self.http:
            client.close()


def refilled(limit: int, started: float) -> float:
    """What a bucket of ``limit`` a minute refilled since ``started``."""
    return (time.monotonic() - started) * limit / 60


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, logs: Path) -> Iterator[list[ProxyProc]]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEYS)
    etcd = EtcdServer(tmp_path_factory.mktemp("etcd"), logs)
    etcd.start()
    started: list[ProxyProc] = []
    try:
        with SimNode(logs, "bounds-node", role="mixed", itl=0.002, output_len=4000) as node:
            flags = ("--etcd", etcd.endpoint, "--mixed", node.host_port, "--model", MODEL, "--api-key-file", str(keys))
            for name in ("replica-0", "replica-1", "replica-2"):
                started.append(ProxyProc(logs, *flags, name=name))
                started[-1].wait_routable("mixed", node.host_port)
            for replica in started:
                wait_until(lambda r=replica: r.status()["replicas"]["count"] == 3, 15, "three replicas counted")
            # Every record is a few seconds old, as in a fleet that has run a while.
            time.sleep(2)
            yield started
    finally:
        for replica in started:
            replica.stop()
        etcd.stop()


def test_every_request_through_one_replica_is_admitted_up_to_the_whole_limit(replicas: list[ProxyProc]) -> None:
    clients, started = Clients(replicas, "one-key"), time.monotonic()
    try:
        statuses = [clients.ask(0) for _ in range(12)]
    finally:
        clients.close()
    assert 9 <= clients.admitted <= 9 + refilled(9, started) + 1, statuses
    assert statuses[-1] == 429


def test_a_90_10_split_is_admitted_the_whole_limit(replicas: list[ProxyProc]) -> None:
    clients, started = Clients(replicas, "split-key"), time.monotonic()
    try:
        # 19 requests, 9 of every 10 through replica 0, the tenth through replica 1.
        for index in range(19):
            clients.ask(1 if index % 10 == 9 else 0)
    finally:
        clients.close()
    assert 10 - 1 <= clients.admitted <= 10 + refilled(10, started) + 1


def test_a_client_that_pauses_and_comes_back_through_another_replica_gets_what_was_left(
    replicas: list[ProxyProc],
) -> None:
    clients, started = Clients(replicas, "pause-key"), time.monotonic()
    try:
        assert [clients.ask(0) for _ in range(5)] == [200] * 5
        time.sleep(3)  # the client reconnects; the balancer puts it on replica 2
        for _ in range(11):
            clients.ask(2)
    finally:
        clients.close()
    assert 10 - 1 <= clients.admitted <= 10 + refilled(10, started) + 1


def test_traffic_that_moves_back_and_forth_is_admitted_the_whole_limit(replicas: list[ProxyProc]) -> None:
    clients, started = Clients(replicas, "move-key"), time.monotonic()
    try:
        for replica in (0, 1, 0, 2):  # a client reconnecting again and again, 3 requests a connection
            for _ in range(3):
                clients.ask(replica)
    finally:
        clients.close()
    assert 10 - 1 <= clients.admitted <= 10 + refilled(10, started) + 1


def test_a_new_tenants_first_burst_through_one_replica_is_admitted_the_whole_limit(
    replicas: list[ProxyProc],
) -> None:
    clients, started = Clients(replicas, "burst-key"), time.monotonic()
    try:
        statuses = [clients.ask(1) for _ in range(8)]
    finally:
        clients.close()
    assert 6 - 1 <= clients.admitted <= 6 + refilled(6, started) + 1, statuses
    assert statuses[:5] == [200] * 5 and statuses[-1] == 429


def at_every_replica_at_once(clients: Clients, burst: Callable[[int], None]) -> None:
    """``burst(replica)`` in a thread per replica, all started together; the clients closed at the end."""
    threads = [threading.Thread(target=burst, args=(i,)) for i in range(len(clients.http))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        clients.close()


def test_bursts_at_every_replica_at_once_are_admitted_no_more_than_the_limit(replicas: list[ProxyProc]) -> None:
    clients, started = Clients(replicas, "all-key"), time.monotonic()
    counts = [0, 0, 0]

    def burst(replica: int) -> None:
        counts[replica] = sum(clients.ask(replica) == 200 for _ in range(12))

    at_every_replica_at_once(clients, burst)
    # Each replica holds a third of 12 before any record; the fleet never admits a second bucket.
    assert 12 - 1 <= sum(counts) <= 12 + refilled(12, started) + 1, counts


def test_tpm_through_another_replica_after_a_pause_gets_what_was_left(replicas: list[ProxyProc]) -> None:
    clients, started = Clients(replicas, "tpm-pause-key"), time.monotonic()
    try:
        while clients.tokens < 300:  # half of tpm=600 through replica 0 (about 30 tokens a request)
            assert clients.ask(0, max_tokens=20) == 200
        time.sleep(3)
        while clients.ask(2, max_tokens=20) == 200:
            pass
    finally:
        clients.close()
    # Admitted while the bucket is not in debt: up to one request more than the limit, as one replica would.
    assert 600 - 40 <= clients.tokens <= 600 + refilled(600, started) + 40


def test_tpm_bursts_at_every_replica_at_once_spend_no_more_than_the_limit(replicas: list[ProxyProc]) -> None:
    clients, started = Clients(replicas, "tpm-all-key"), time.monotonic()

    def burst(replica: int) -> None:
        while clients.ask(replica, max_tokens=20) == 200:
            pass

    at_every_replica_at_once(clients, burst)
    # Each replica's last request may take its bucket into debt: at most one request (~30 tokens) each.
    assert 600 - 40 <= clients.tokens <= 600 + refilled(600, started) + 3 * 40


def test_a_new_tenants_streams_through_one_replica_get_the_whole_concurrency(replicas: list[ProxyProc]) -> None:
    streams = [HeldStream(replicas[0].url, "conc-burst-key") for _ in range(5)]
    try:
        statuses = sorted(s.wait() for s in streams)
    finally:
        for stream in streams:
            stream.release()
    assert statuses == [200, 200, 200, 200, 429]


def test_concurrency_follows_a_client_that_moves_to_another_replica(replicas: list[ProxyProc]) -> None:
    first = [HeldStream(replicas[0].url, "conc-move-key") for _ in range(4)]
    try:
        assert sorted(s.wait() for s in first) == [200] * 4
    finally:
        for stream in first:
            stream.release()
    # Its streams ended; it reconnects through replica 2 and opens four again.
    moved = [HeldStream(replicas[2].url, "conc-move-key") for _ in range(5)]
    try:
        statuses = sorted(s.wait() for s in moved)
    finally:
        for stream in moved:
            stream.release()
    assert statuses == [200, 200, 200, 200, 429]


def test_streams_opened_at_every_replica_at_once_hold_no_more_than_the_concurrency(
    replicas: list[ProxyProc],
) -> None:
    streams = [HeldStream(replicas[i % 3].url, "conc-all-key") for i in range(12)]
    try:
        statuses = [s.wait() for s in streams]
    finally:
        for stream in streams:
            stream.release()
    assert statuses.count(200) == 6, statuses
