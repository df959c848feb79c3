"""Nodes come, go, restart, crash and hang under a steady load through two replicas; every request counts.

Scenarios 1-4 of issue 3, and 10-11: with stream resume, a node that dies or hangs mid-stream costs no request
(scenarios 3 and 10), except the streams that must not resume (11). Each prints its request counts (run pytest
with -s or -rA to see them).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.faults.fleet import SIM_KNOBS, Fleet, FleetNode, broken_logged, holds, resumes_counted, resumes_logged
from tests.faults.load import MIXED_MODEL, MODEL, SSE_ERROR, Load, describe, expected_answers, report
from tests.faults.midstream import AT_ONCE, Burst, Snapshot, differing
from tests.support.blackhole import Blackhole
from tests.support.etcd_watch import EtcdWatch
from tests.support.procs import wait_until

WATCH_PREFIX = "/vllm/"
"""etcdctl watches above the cluster prefix, so its readiness marker is not a (bad) node key."""


def _first_request_via(node: FleetNode, replica_index: int) -> float | None:
    """time.time() when ``node`` received its first load request sent through replica ``replica_index``."""
    prefix = f"load-r{replica_index}-"
    times = [r["received_at"] for r in node.sim.requests() if (r.get("request_id") or "").startswith(prefix)]
    return min(times, default=None)


def test_scale_out_and_in_under_load_loses_nothing_and_new_nodes_get_traffic_within_a_second(
    fleet: Fleet, logs_dir: Path
) -> None:
    fleet.start()
    replicas = range(len(fleet.replicas))
    with (
        EtcdWatch(fleet.etcd.endpoint, WATCH_PREFIX, logs_dir) as watch,
        Load([r.url for r in fleet.replicas], clients=10) as load,
    ):
        # 10 clients: ~12 requests/s per model per replica, so "within a second" measures the proxy, not the load.
        watch.wait_ready(fleet.etcd.etcdctl)
        load.wait_for(20)

        joining = [fleet.node("decode"), fleet.node("mixed")]
        fleet.launch(joining)
        registered = {n.name: watch.wait_for("PUT", n.key, timeout=20).wall for n in joining}
        wait_until(
            lambda: all(_first_request_via(n, i) is not None for n in joining for i in replicas),
            10,
            "traffic to the new nodes through both replicas",
        )
        delays = {
            f"{n.name}@r{i}": round(_first_request_via(n, i) - registered[n.name], 3)  # type: ignore[operator]
            for n in joining
            for i in replicas
        }

        leaving = [fleet.nodes[2], fleet.nodes[4]]  # decode-1 and mixed-1
        assert [n.name for n in leaving] == ["decode-1", "mixed-1"]
        with ThreadPoolExecutor(len(leaving)) as pool:
            list(pool.map(fleet.deregister, leaving))
        for node in leaving:
            node.sim.stop()
        fleet.wait_converged()
        load.wait_for(20)
    outcomes = load.outcomes()
    report(1, "scale out 2 + scale in 2", outcomes, first_traffic_delay_s=delays)
    failed = [o for o in outcomes if not o.succeeded]
    assert not failed, f"{len(failed)} failed requests (logs in {logs_dir}):\n{describe(failed)}"
    assert all(d <= 1.0 for d in delays.values()), f"new nodes got traffic too late: {delays}"


def test_rolling_restart_of_every_node_through_its_registrar_loses_no_request(fleet: Fleet, logs_dir: Path) -> None:
    fleet.start()
    with Load([r.url for r in fleet.replicas]) as load:
        load.wait_for(20)
        for node in list(fleet.nodes):
            fleet.deregister(node)  # draining -> idle -> lease revoked -> exit 0
            for replica in fleet.replicas:
                replica.wait_gone(node.role, node.node_id, timeout=5)
            node.sim.stop()
            fleet.launch([node])  # the same port, a new registrar
            for replica in fleet.replicas:
                replica.wait_routable(node.role, node.node_id, timeout=20)
        load.wait_for(20)
        # Every restarted node is back in rotation (its records start at its restart).
        wait_until(lambda: all(n.sim.requests() for n in fleet.nodes), 10, "traffic to every restarted node")
    outcomes = load.outcomes()
    report(2, f"rolling restart of {len(fleet.nodes)} nodes", outcomes)
    failed = [o for o in outcomes if not o.succeeded]
    assert not failed, f"{len(failed)} failed requests (logs in {logs_dir}):\n{describe(failed)}"


LONG_STREAM = 60
"""Tokens per streamed load request in the mid-stream scenarios: ~0.6 s each, so several are mid-stream at the
fault besides the burst's."""


def _victim_and_witness(fleet: Fleet, role: str) -> tuple[FleetNode, FleetNode]:
    """The node a scenario breaks, and a node of the same role that stays healthy (it answers the oracle)."""
    victim, witness = [n for n in fleet.nodes if n.role == role][:2]
    return victim, witness


def _busy_and_other(fleet: Fleet, role: str, burst: Burst) -> tuple[FleetNode, FleetNode]:
    """Of the role's two nodes, one generating ``AT_ONCE`` of the burst's streams and 2 of its full answers (the
    victim), and the other (the witness); waits for one to be that busy."""
    pair = [n for n in fleet.nodes if n.role == role][:2]
    busy: list[FleetNode] = []

    def one_busy() -> bool:
        # The node seen busy is the victim: asking again would delay the fault while its requests run on.
        busy[:] = [n for n in pair if burst.busy(n)][:1]
        return bool(busy)

    wait_until(one_busy, 15, f"{AT_ONCE} streams and 2 full answers generating on one {role} node")
    return busy[0], next(n for n in pair if n is not busy[0])


@pytest.mark.parametrize("role", ["decode", "mixed"])
def test_kill_9_of_a_node_mid_stream_resumes_its_streams_elsewhere_with_the_same_text_then_its_lease_removes_it(
    fleet: Fleet, logs_dir: Path, role: str
) -> None:
    fleet.start()
    model = MIXED_MODEL if role == "mixed" else MODEL
    with (
        EtcdWatch(fleet.etcd.endpoint, WATCH_PREFIX, logs_dir) as watch,
        Load([r.url for r in fleet.replicas], stream_max_tokens=LONG_STREAM) as load,
    ):
        watch.wait_ready(fleet.etcd.etcdctl)
        load.wait_for(20)
        burst = Burst.spawn(load, fleet.replicas, model)
        # The victim is whichever node the policy gave enough of the burst (cache-aware, the mixed nodes' default,
        # places each prompt by its hash, so either node may hold most of it).
        victim, witness = _busy_and_other(fleet, role, burst)
        at_kill = Snapshot.of(victim)
        fleet.crash(victim)
        killed, killed_wall = time.monotonic(), time.time()
        deleted = watch.wait_for("DELETE", victim.key, timeout=fleet.ttl + 10)
        for replica in fleet.replicas:
            replica.wait_gone(role, victim.node_id, timeout=5)
        burst.outcomes()
        load.wait_for(30, after=killed)
    outcomes = load.outcomes()
    by_id = {o.request_id: o for o in outcomes}
    resumes = resumes_logged(fleet.replicas)
    resumed = {r.request_id for r in resumes}
    # The burst's requests have ~2 s to go at the kill: those on the victim cannot have ended on it before it died.
    must_resume, must_retry = at_kill.streams & set(burst.futures), at_kill.full & set(burst.futures)
    checked = resumed | at_kill.streams | at_kill.full | set(burst.futures)
    expected = expected_answers((witness.sim.url, by_id[i]) for i in checked)
    report(
        3,
        f"kill -9 of a {role} node mid-stream",
        outcomes,
        streams_on_victim=len(at_kill.streams),
        full_on_victim=len(at_kill.full),
        resumed=len(resumed),
        compared_with_a_healthy_node=len(checked),
        started_after_kill=sum(o.started >= killed for o in outcomes),
        lease_expired_after_s=round(deleted.wall - killed_wall, 2),
    )
    failed = [o for o in outcomes if not o.succeeded]
    assert not failed, f"{len(failed)} failed requests (logs in {logs_dir}):\n{describe(failed)}"
    assert len(at_kill.streams) >= AT_ONCE, f"only {len(at_kill.streams)} streams on the victim at the kill"
    assert must_resume <= resumed, f"streams not resumed (logs in {logs_dir}): {sorted(must_resume - resumed)}"
    elsewhere = [r for r in resumes if r.source != victim.node_id or r.target in (victim.node_id, "")]
    assert not elsewhere, f"resumes other than from the victim to another node: {elsewhere}"
    assert all(by_id[i].node == victim.node_id and by_id[i].stream for i in resumed)
    assert {r.replica for r in resumes} == {r.proc.name for r in fleet.replicas}, "both replicas resumed streams"
    assert resumes_counted(fleet.replicas, "resumed") == len(resumes) == len(resumed)
    assert resumes_counted(fleet.replicas, "failed") == resumes_counted(fleet.replicas, "exhausted") == 0
    # A full answer cut off by the kill was sent whole to another node, and nothing reached the client before.
    assert must_retry and all(by_id[i].node not in (victim.node_id, None) for i in must_retry), describe(
        [by_id[i] for i in must_retry]
    )
    # The burst's other requests went through the usual flow and agree with the direct requests: that makes the
    # healthy node's answer the right reference (for a P/D fleet, decode alone gives what prefill + decode give).
    assert len(set(burst.futures) - must_resume - must_retry) >= 4
    wrong = differing((by_id[i] for i in sorted(checked)), expected)
    assert not wrong, f"{len(wrong)} answers differ from a healthy node's ({logs_dir}):\n" + "\n".join(wrong[:4])
    assert deleted.wall - killed_wall <= fleet.ttl + 3, "the lease outlived its TTL by far"


IDLE_TIMEOUT = 1.0
"""--stream-idle-timeout in scenario 10: how long a replica waits on a silent stream before resuming it."""
HANG_ITL = 0.03
"""Seconds per token on the decode nodes during scenario 10's burst: its streams last ~6 s. On a busy machine the
burst's 52 requests take seconds to reach the nodes (the run-time is the CPU's, not the proxy's); at the usual
10 ms a token the first streams end before the last ones start, and no node ever holds AT_ONCE of them."""
HANG_FULL_TOKENS = 60
"""Tokens of the burst's full answers in scenario 10: ~1.8 s at HANG_ITL, long enough to be caught generating on
the victim, well within its --first-byte-timeout (a full answer stuck on the hung node goes whole to another node
after it)."""
HANG_FLAGS = ("--stream-idle-timeout", str(IDLE_TIMEOUT), "--first-byte-timeout", "4")


def test_node_hanging_mid_stream_has_its_streams_resumed_after_the_idle_timeout_with_the_same_text(
    fleet: Fleet, logs_dir: Path
) -> None:
    fleet.start(proxy_flags=HANG_FLAGS)
    decode = [n for n in fleet.nodes if n.role == "decode"]
    with Load([r.url for r in fleet.replicas], stream_max_tokens=LONG_STREAM) as load:
        load.wait_for(20)
        for node in decode:
            node.sim.configure(itl=HANG_ITL)
        burst = Burst.spawn(load, fleet.replicas, MODEL, full_tokens=HANG_FULL_TOKENS)
        victim, witness = _busy_and_other(fleet, "decode", burst)
        # Every generation on the victim stops before its next token, connections open: a wedged engine.
        victim.sim.configure(hang_after_tokens=1)
        hung = time.monotonic()
        witness.sim.configure(itl=SIM_KNOBS["itl"])
        burst.outcomes()
        load.wait_for(20, after=hung)
    outcomes = load.outcomes()
    by_id = {o.request_id: o for o in outcomes}
    resumes = resumes_logged(fleet.replicas)
    resumed = {r.request_id for r in resumes}
    on_victim = {r["request_id"]: r for r in victim.sim.requests()}
    # Caught by the hang: every request on the victim that did not end there. Not a snapshot taken before the hang:
    # on a busy machine the test's next call reaches the node a second or more later, and a request seen running
    # may have ended whole in between; one sent to the victim after the hang is caught as well.
    stuck = [(i, r["stream"]) for i, r in on_victim.items() if r["state"] != "done"]
    at_hang = Snapshot(streams=frozenset(i for i, st in stuck if st), full=frozenset(i for i, st in stuck if not st))
    must_resume, must_retry = at_hang.streams & set(burst.futures), at_hang.full & set(burst.futures)
    checked = resumed | at_hang.streams | at_hang.full | set(burst.futures)
    expected = expected_answers((witness.sim.url, by_id[i]) for i in checked)
    report(
        10,
        "a decode node hangs mid-stream",
        outcomes,
        streams_on_victim=len(at_hang.streams),
        full_on_victim=len(at_hang.full),
        resumed=len(resumed),
        compared_with_a_healthy_node=len(checked),
    )
    failed = [o for o in outcomes if not o.succeeded]
    assert not failed, f"{len(failed)} failed requests (logs in {logs_dir}):\n{describe(failed)}"
    assert len(must_resume) >= AT_ONCE, f"only {len(must_resume)} of the burst's streams caught on the victim"
    assert must_resume <= resumed, f"streams not resumed (logs in {logs_dir}): {sorted(must_resume - resumed)}"
    wrong_resumes = [
        r
        for r in resumes
        if r.source != victim.node_id or r.target in (victim.node_id, "") or "stream idle timeout" not in r.reason
    ]
    assert not wrong_resumes, f"resumes other than from the silent victim: {wrong_resumes}"
    assert resumes_counted(fleet.replicas, "resumed") == len(resumes) == len(resumed)
    assert resumes_counted(fleet.replicas, "failed") == resumes_counted(fleet.replicas, "exhausted") == 0
    # The replicas let go of the silent streams: the node saw each client leave (its slots are free again).
    held = sorted(i for i in resumed if on_victim[i]["state"] != "cancelled")
    assert not held, f"resumed streams still held open on the hung node: {held}"
    assert must_retry and all(by_id[i].node not in (victim.node_id, None) for i in must_retry), describe(
        [by_id[i] for i in must_retry]
    )
    wrong = differing((by_id[i] for i in sorted(checked)), expected)
    assert not wrong, f"{len(wrong)} answers differ from a healthy node's ({logs_dir}):\n" + "\n".join(wrong[:4])


GUIDED = {"guided_json": {"type": "object"}}
"""Guided decoding: a continuation could not honour the grammar's state, so such a stream must not resume."""


def test_kill_9_mid_stream_ends_streams_that_must_not_resume_with_the_error_event_as_before(
    fleet: Fleet, logs_dir: Path
) -> None:
    fleet.start()
    victim, witness = _victim_and_witness(fleet, "decode")
    with Load([r.url for r in fleet.replicas], stream_max_tokens=LONG_STREAM) as load:
        load.wait_for(20)
        guided = Burst.spawn(load, fleet.replicas, MODEL, tag="guided", streams=12, full=0, extra=GUIDED)
        plain = Burst.spawn(load, fleet.replicas, MODEL, tag="plain", streams=8, full=0)
        wait_until(
            lambda: guided.busy(victim, streams=3, full=0) and plain.busy(victim, streams=2, full=0),
            15,
            "guided and plain streams generating on the victim",
        )
        at_kill = Snapshot.of(victim)
        fleet.crash(victim)
        killed = time.monotonic()
        guided.outcomes()
        plain.outcomes()
        load.wait_for(20, after=killed)
    outcomes = load.outcomes()
    by_id = {o.request_id: o for o in outcomes}
    cut = at_kill.streams & set(guided.futures)
    resumes = resumes_logged(fleet.replicas)
    resumed = {r.request_id for r in resumes}
    expected = expected_answers((witness.sim.url, by_id[i]) for i in [*guided.futures, *plain.futures])
    report(
        11,
        "kill -9 mid-stream of streams that must not resume",
        outcomes,
        guided_on_victim=len(cut),
        plain_on_victim=len(at_kill.streams & set(plain.futures)),
        resumed=len(resumed),
    )
    failed = [o for o in outcomes if not o.succeeded and o.request_id not in cut]
    assert not failed, f"{len(failed)} failed requests (logs in {logs_dir}):\n{describe(failed)}"
    assert len(cut) >= 3
    # As before resume existed: the tokens so far, one error event, one [DONE]; logged as a broken stream.
    ended = [by_id[i] for i in sorted(cut)]
    wrong_end = [
        o
        for o in ended
        if not (
            o.result == SSE_ERROR
            and o.error_events == 1
            and o.dones == 1
            and o.node == victim.node_id
            and o.answer is not None
            and o.answer.text
            and expected[o.request_id].text.startswith(o.answer.text)
            and o.answer.text != expected[o.request_id].text
        )
    ]
    assert not wrong_end, f"guided streams on the victim did not end with the error event:\n{describe(wrong_end)}"
    assert cut <= broken_logged(fleet.replicas)
    assert not cut & resumed, f"streams that must not resume were resumed: {sorted(cut & resumed)}"
    # ...while the resumable streams on the victim, killed at the same moment, did resume; only they were counted.
    assert at_kill.streams & set(plain.futures) <= resumed
    assert resumes_counted(fleet.replicas, "resumed") == len(resumes) == len(resumed)
    assert resumes_counted(fleet.replicas, "failed") == resumes_counted(fleet.replicas, "exhausted") == 0
    finished = [by_id[i] for i in sorted({*guided.futures, *plain.futures} - cut)]
    wrong = differing(finished, expected)
    assert not wrong, f"{len(wrong)} answers differ from a healthy node's ({logs_dir}):\n" + "\n".join(wrong[:4])


HANG_TIMEOUT = 1.5
"""--first-byte-timeout for scenario 4: how long a request waits on the hung node before failing over."""


def test_node_that_accepts_but_never_answers_is_failed_over_within_the_timeout_and_ejected(
    fleet: Fleet, logs_dir: Path
) -> None:
    flags = ("--first-byte-timeout", str(HANG_TIMEOUT), "--eject-after", "2", "--eject-backoff", "1")
    fleet.start(prefill=1, decode=2, mixed=2, proxy_flags=flags)
    hole = Blackhole().start()
    key = f"/vllm/default/decode/{hole.host_port}"
    record = {"url": hole.url, "role": "decode", "models": [MODEL], "status": "serving"}
    lease = fleet.etcd.etcdctl("lease", "grant", "120").split()[1]  # alive all along: only its HTTP is dead

    def ejected_everywhere() -> bool:
        return all(any(w["id"] == hole.host_port and w["ejected"] for w in r.workers()) for r in fleet.replicas)

    try:
        with Load([r.url for r in fleet.replicas]) as load:
            load.wait_for(20)
            fleet.etcd.etcdctl("put", f"--lease={lease}", key, json.dumps(record))
            wait_until(ejected_everywhere, 20, "every replica to eject the hung node")
            ejected = time.monotonic()
            holds(ejected_everywhere, 3.0, "the hung node ejected on every replica")
            load.wait_for(20, after=ejected)
    finally:
        hole.close()
    outcomes = load.outcomes()
    by_id = {o.request_id: o for o in outcomes}
    sent = hole.seen("POST")
    late = [s for s in sent if s.at > ejected + 0.5]
    failed_over = [by_id[s.request_id] for s in sent if s.request_id in by_id]
    report(
        4,
        "node accepts connections, never answers",
        outcomes,
        sent_to_hung_node=len(sent),
        failed_over=len(failed_over),
        max_failover_s=round(max(o.duration for o in failed_over), 2),
    )
    failed = [o for o in outcomes if not o.succeeded]
    assert not failed, f"{len(failed)} failed requests (logs in {logs_dir}):\n{describe(failed)}"
    assert {s.request_id.split("-")[1] for s in sent if s.request_id} == {"r0", "r1"}, "both replicas tried it"
    assert len(failed_over) == len(sent)
    slow = [o for o in failed_over if not HANG_TIMEOUT - 0.05 <= o.duration <= HANG_TIMEOUT + 1.5]
    assert not slow, f"fail-over not within the {HANG_TIMEOUT}s timeout:\n{describe(slow)}"
    assert not late, f"{len(late)} requests reached the hung node after it was ejected everywhere: {late}"
