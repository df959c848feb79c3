"""etcd fails under a steady load through two replicas: down past the lease TTL, compacted behind a cut-off
replica's back, a cluster losing its leader. Scenarios 5-7 of issue 3; each prints its request counts."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.faults.conftest import EtcdRelay
from tests.faults.fleet import Etcd, Fleet, holds
from tests.faults.load import Load, describe, report
from tests.support.etcd_cluster import EtcdCluster
from tests.support.etcd_server import EtcdServer
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc


def _wait_connected(replica: ProxyProc, connected: bool, timeout: float) -> None:
    """Until the replica's /status says its etcd watch is (or is not) connected."""
    wait_until(
        lambda: replica.status()["discovery"]["connected"] is connected,
        timeout,
        f"{replica.proc.name} to report connected={connected}",
    )


def test_etcd_down_longer_than_the_lease_ttl_loses_no_request_and_pools_match_etcd_after(
    fleet: Fleet, etcd: EtcdServer, logs_dir: Path
) -> None:
    fleet.start()
    everyone = {n.pair for n in fleet.nodes}
    with Load([r.url for r in fleet.replicas]) as load:
        load.wait_for(20)
        etcd.stop()
        down = time.monotonic()
        for replica in fleet.replicas:
            _wait_connected(replica, False, 15)
        # Down for longer than the TTL, while the replicas keep serving from their last pools.
        holds(lambda: not load.failures(), fleet.ttl + 2 - (time.monotonic() - down), "no failed request")
        etcd.start()
        up = time.monotonic()
        for replica in fleet.replicas:
            _wait_connected(replica, True, 20)
        wait_until(lambda: fleet.registered() == everyone, 20, "every registrar to register again")
        fleet.wait_converged(everyone)
        load.wait_for(20)
    outcomes = load.outcomes()
    during = [o for o in outcomes if down <= o.started < up]
    report(
        5,
        "etcd down past the lease TTL",
        outcomes,
        during_outage=len(during),
        outage_s=round(up - down, 1),
        ttl_s=fleet.ttl,
    )
    failed = [o for o in outcomes if not o.succeeded]
    assert not failed, f"{len(failed)} failed requests (logs in {logs_dir}):\n{describe(failed)}"
    assert len(during) >= 20, "the load did not go on during the outage"
    assert all(fleet.pool(r) == fleet.registered() for r in fleet.replicas)


def test_replica_cut_off_from_etcd_across_a_compaction_relists_and_applies_the_deletes_it_missed(
    fleet: Fleet, etcd: EtcdServer, etcd_relay: EtcdRelay, logs_dir: Path
) -> None:
    fleet.start(replica_etcd=[etcd_relay.endpoint, etcd.endpoint])
    cut_off, connected = fleet.replicas
    before = {n.pair for n in fleet.nodes}
    newcomer = fleet.node("decode")  # a node that only shows up while the replica is cut off
    fleet.launch([newcomer], register=False)
    with Load([r.url for r in fleet.replicas]) as load:
        load.wait_for(20)
        etcd_relay.cut()
        _wait_connected(cut_off, False, 15)
        watched = cut_off.status()["discovery"]["revision"]

        removed = [n for n in fleet.nodes if n.name in ("decode-1", "mixed-1")]
        for node in removed:  # an operator removes them; they keep running, so stale routes still work
            fleet.etcd.etcdctl("del", node.key)
        fleet.etcd.etcdctl("put", newcomer.key, "")  # a bare key: models from the node's /v1/models
        fleet.etcd.etcdctl("put", "/unrelated/bump", "1")
        compacted = fleet.etcd.revision()
        fleet.etcd.etcdctl("compact", str(compacted))
        after = (before - {n.pair for n in removed}) | {newcomer.pair}

        fleet.wait_converged(after, replicas=[connected])
        assert fleet.pool(cut_off) == before, "the cut-off replica cannot have seen the changes"
        etcd_relay.restore()
        fleet.wait_converged(after, replicas=[cut_off])
        resyncs = cut_off.status()["discovery"]["resyncs"]
        load.wait_for(20)
    outcomes = load.outcomes()
    report(
        6,
        "compaction past a cut-off replica's watch",
        outcomes,
        watch_revision=watched,
        compacted_at=compacted,
        resyncs=resyncs,
    )
    failed = [o for o in outcomes if not o.succeeded]
    assert not failed, f"{len(failed)} failed requests (logs in {logs_dir}):\n{describe(failed)}"
    assert watched < compacted and resyncs >= 1, "the replica did not re-list after the compaction"
    assert fleet.registered() == after


def _leader(cluster: EtcdCluster) -> int:
    statuses = json.loads(Etcd(",".join(cluster.endpoints)).etcdctl("endpoint", "status", "-w", "json"))
    leaders = [s["Endpoint"] for s in statuses if s["Status"]["header"]["member_id"] == s["Status"]["leader"]]
    assert len(leaders) == 1, statuses
    return cluster.endpoints.index(leaders[0])


def test_etcd_cluster_losing_its_leader_loses_no_request_and_registrations_continue(
    cluster_fleet: Fleet, cluster: EtcdCluster, logs_dir: Path
) -> None:
    fleet = cluster_fleet
    fleet.start()
    with Load([r.url for r in fleet.replicas]) as load:
        load.wait_for(20)
        leader = _leader(cluster)
        cluster.members[leader].kill()
        killed = time.monotonic()
        survivors = Etcd(",".join(e for i, e in enumerate(cluster.endpoints) if i != leader))
        newcomer = fleet.node("decode")
        fleet.launch([newcomer])  # a registration that starts after the leader died
        everyone = {n.pair for n in fleet.nodes}
        wait_until(lambda: fleet.registered(via=survivors) == everyone, 30, "the newcomer to register")
        fleet.wait_converged(everyone)
        # Nobody notices: no key is lost, on into the time the old leases would have expired.
        holds(
            lambda: fleet.registered(via=survivors) == everyone,
            max(0.0, killed + fleet.ttl + 1 - time.monotonic()),
            "every registration",
        )
        fleet.wait_converged(everyone)
        load.wait_for(20)
        wait_until(lambda: bool(newcomer.sim.requests()), 10, "traffic to the newcomer")
    outcomes = load.outcomes()
    report(
        7,
        "etcd cluster loses its leader",
        outcomes,
        killed_member=cluster.members[leader].name,
        started_after_kill=sum(1 for o in outcomes if o.started >= killed),
    )
    failed = [o for o in outcomes if not o.succeeded]
    assert not failed, f"{len(failed)} failed requests (logs in {logs_dir}):\n{describe(failed)}"
