"""A replica shuts down and a client walks away, under a steady load through two replicas.
Scenarios 8-9 of issue 3; each prints its request counts."""

from __future__ import annotations

import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.faults.fleet import Fleet
from tests.faults.load import DISAGG_STREAM, DISCONNECTED, MIXED_STREAM, OK, Load, Outcome, describe, report
from tests.support.procs import wait_until

LONG = 300
"""Tokens of a long stream: ~3 s at the nodes' 10 ms inter-token latency."""


def _refuses(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.ConnectError:
        return True
    return False


def test_replica_sigterm_during_long_streams_lets_every_stream_complete(fleet: Fleet, logs_dir: Path) -> None:
    fleet.start()
    leaving, staying = fleet.replicas
    generators = [n for n in fleet.nodes if n.role in ("decode", "mixed")]

    def generating(request_id: str) -> bool:
        return any(
            r["request_id"] == request_id and r["state"] == "running" and r["completion_tokens"] >= 1
            for n in generators
            for r in n.sim.requests()
        )

    with Load([leaving.url, staying.url]) as load:
        load.wait_for(20)
        for node in generators:  # short record lists: quick polls
            node.sim.clear_requests()
        kinds = [DISAGG_STREAM, MIXED_STREAM] * 2
        streams = [
            load.spawn(leaving.url, kind, max_tokens=LONG, request_id=f"long-{i}") for i, kind in enumerate(kinds)
        ]
        wait_until(lambda: all(generating(f"long-{i}") for i in range(len(kinds))), 10, "every long stream")
        # The operator drains the replica in the L4 balancer, then stops it.
        load.exclude(leaving.url)
        leaving.proc.signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until(lambda: _refuses(leaving.url), 5, "the replica to stop accepting connections")
        running_when_closed = sum(1 for s in streams if not s.done())
        finished = [s.result(timeout=30) for s in streams]
        code = leaving.proc.wait(30)
        exited = time.monotonic()
        load.wait_for(20, after=exited)
    outcomes = load.outcomes()
    report(
        8,
        "replica SIGTERM during long streams",
        outcomes,
        long_streams=len(streams),
        running_when_listener_closed=running_when_closed,
        exit_code=code,
        exited_after_s=round(exited - signalled, 2),
    )
    failed = [o for o in outcomes if not o.succeeded]
    assert not failed, f"{len(failed)} failed requests (logs in {logs_dir}):\n{describe(failed)}"
    assert running_when_closed == len(streams), "the streams ended before the replica stopped accepting"
    broken = [o for o in finished if o.result != OK or o.tokens != LONG]
    assert not broken, f"long streams cut short:\n{describe(broken)}"
    assert code in (0, -signal.SIGTERM), f"the replica exited with {code} (logs in {logs_dir})"
    assert exited >= max(o.ended for o in finished) - 0.1, "the replica exited before its streams ended"


def _cancelled_within(client: httpx.Client, left: Outcome, limit: float) -> float | None:
    """Poll the node that streamed ``left`` (through ``client``) until it records the request cancelled; the
    monotonic time it was seen so, or None if not within ``limit`` s of the client leaving. An upper bound:
    a poll takes a few ms."""
    while time.monotonic() <= left.ended + limit:
        records = client.get("/sim/requests").json()["requests"]
        if any(r["request_id"] == left.request_id and r["cancelled"] for r in records):
            return time.monotonic()
        time.sleep(0.01)
    return None


def test_client_disconnecting_mid_stream_cancels_the_node_request_within_a_second(fleet: Fleet, logs_dir: Path) -> None:
    fleet.start()
    with Load([r.url for r in fleet.replicas]) as load:
        load.wait_for(20)
        for node in fleet.nodes:  # short record lists: quick polls, a tighter measure
            node.sim.clear_requests()
        spawned = {
            f"gone-r{i}-{kind.name.split('/')[0]}": (replica, kind)
            for i, replica in enumerate(fleet.replicas)
            for kind in (DISAGG_STREAM, MIXED_STREAM)
        }
        # Clients and threads ready before anyone leaves: the measure starts the moment a client is gone.
        clients = {n.node_id: httpx.Client(base_url=n.sim.url, timeout=2) for n in fleet.nodes}

        def watch(future: Future[Outcome]) -> tuple[Outcome, float | None]:
            outcome = future.result(timeout=20)
            if outcome.result != DISCONNECTED or outcome.node not in clients:
                return outcome, None
            return outcome, _cancelled_within(clients[outcome.node], outcome, 1.0)

        try:
            with ThreadPoolExecutor(len(spawned)) as pool:
                watchers = {
                    rid: pool.submit(
                        watch, load.spawn(replica.url, kind, max_tokens=LONG, request_id=rid, disconnect_after=3)
                    )
                    for rid, (replica, kind) in spawned.items()
                }
                results = {rid: w.result() for rid, w in watchers.items()}
        finally:
            for client in clients.values():
                client.close()
        load.wait_for(20)
    outcomes = load.outcomes()
    left = {rid: outcome for rid, (outcome, _) in results.items()}
    delays = {rid: round(at - left[rid].ended, 3) for rid, (_, at) in results.items() if at is not None}
    report(9, "client disconnects mid-stream", outcomes, disconnects=len(left), cancelled_after_s=delays)
    failed = [o for o in outcomes if not o.succeeded]
    assert not failed, f"{len(failed)} failed requests (logs in {logs_dir}):\n{describe(failed)}"
    assert all(o.result == DISCONNECTED for o in left.values()), describe(list(left.values()))
    late = sorted(rid for rid, (_, at) in results.items() if at is None)
    assert not late, f"not cancelled on the node within 1 s: {late}; cancelled: {delays} (logs in {logs_dir})"
