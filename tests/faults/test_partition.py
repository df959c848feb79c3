"""A silent network partition between etcd and one replica, or one registrar (issue 16): every byte dropped, no
connection closed. The replica must say so within the bound and catch up within 5 s of the path healing; the
registrar must keep its key through a partition shorter than its TTL minus the lease bound. Production defaults
(``--etcd-dead-after 3``, ``--ttl 10``) throughout; each test prints what it measured."""

from __future__ import annotations

import time
from pathlib import Path

from tests.faults.conftest import EtcdRelay
from tests.faults.fleet import Etcd, Fleet, holds
from tests.support.etcd_server import EtcdServer
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.registrar_proc import Registrar, lease_ttl, read_key, wait_for_key
from tests.support.sim_node import SimNode
from vllm_etcd_proxy.fleet.etcd import EtcdSettings

DEFAULTS = EtcdSettings(endpoints=("127.0.0.1:2379",))
"""What both programs run with when no etcd flag but --etcd is given."""
BOUND = DEFAULTS.dead_after
"""A stream that heard nothing for this long is dead (3 s)."""
SLACK = 1.0
"""For the test's own polling (a /status or etcdctl round trip every 50 ms) on a busy two-core machine."""
HEALED_WITHIN = 5.0
"""Issue 16: a replica behind a partition is back in sync within 5 s of the path healing."""
PARTITION = 8.0
"""Long enough for the replica to try reconnecting a few times, so an attempt is in flight when the path heals."""
TTL = 10
"""The registrar's default --ttl."""


def _connected(replica: ProxyProc) -> bool:
    return bool(replica.status()["discovery"]["connected"])


def test_replica_behind_a_silent_partition_says_so_within_the_bound_and_catches_up_within_5s_of_healing(
    fleet: Fleet, etcd: EtcdServer, etcd_relay: EtcdRelay, logs_dir: Path
) -> None:
    fleet.start(prefill=0, decode=2, mixed=0, replica_etcd=[etcd_relay.endpoint, etcd.endpoint])
    cut_off, direct = fleet.replicas
    leaving = fleet.nodes[0]
    newcomer = fleet.node("decode")  # joins while the replica is cut off
    fleet.launch([newcomer], register=False)
    before = {n.pair for n in fleet.nodes if n is not newcomer}
    after = (before - {leaving.pair}) | {newcomer.pair}

    etcd_relay.partition()
    cut = time.monotonic()
    wait_until(lambda: not _connected(cut_off), BOUND + 2 * SLACK, "the cut-off replica to say connected: false")
    detected = time.monotonic() - cut
    assert _connected(direct)

    fleet.etcd.etcdctl("del", leaving.key)  # an operator removes a node; its registrar leaves it removed
    fleet.etcd.etcdctl("put", newcomer.key, "")
    fleet.wait_converged(after, replicas=[direct])
    assert fleet.pool(cut_off) == before, "the cut-off replica cannot have seen the changes"
    # No way through a partition: every reconnect attempt must give up (and say so) while it lasts.
    holds(lambda: not _connected(cut_off), PARTITION - (time.monotonic() - cut), "connected: false")

    etcd_relay.heal()
    healed = time.monotonic()
    wait_until(lambda: fleet.pool(cut_off) == after, 2 * HEALED_WITHIN, "the cut-off replica to catch up")
    caught_up = time.monotonic() - healed
    wait_until(lambda: _connected(cut_off), HEALED_WITHIN, "connected: true again")
    discovery = cut_off.status()["discovery"]
    print(
        f"scenario 12 [silent partition between a replica and etcd]: detected_s={detected:.2f} "
        f"bound_s={BOUND:g} partition_s={healed - cut:.1f} caught_up_s={caught_up:.2f} "
        f"reconnects={discovery['reconnects']} resyncs={discovery['resyncs']}"
    )
    assert detected <= BOUND + SLACK, f"connected: false after {detected:.2f}s, bound {BOUND:g}s (logs in {logs_dir})"
    assert caught_up <= HEALED_WITHIN, f"caught up {caught_up:.2f}s after healing (logs in {logs_dir})"
    assert discovery["resyncs"] == 0, "the watch should resume from its revision, not re-list"


def test_registrar_behind_a_silent_partition_shorter_than_ttl_minus_the_bound_keeps_its_key_and_lease(
    etcd: EtcdServer, etcd_relay: EtcdRelay, logs_dir: Path
) -> None:
    node = SimNode(logs_dir, "decode-1", role="decode", model="sim-model").start()
    registrar = Registrar(Etcd(etcd_relay.endpoint), node.url, logs_dir, ttl=TTL)  # type: ignore[arg-type]
    try:
        key = f"/vllm/default/decode/{node.host_port}"
        lease = wait_for_key(etcd, key, 20).lease
        lasting = TTL - DEFAULTS.lease_bound - SLACK  # 5 s: the longest partition it must survive, less slack

        etcd_relay.partition()
        cut = time.monotonic()
        registrar.wait_for_log("etcd lease keepalive failed", BOUND + 2 * SLACK)
        noticed = time.monotonic() - cut

        def same_key() -> bool:
            entry = read_key(etcd, key)
            return entry is not None and entry.lease == lease

        holds(same_key, lasting - (time.monotonic() - cut), "the key under its first lease", interval=0.25)
        etcd_relay.heal()
        healed = time.monotonic()
        wait_until(lambda: lease_ttl(etcd, lease) >= TTL - 1, DEFAULTS.dead_after + 2 * SLACK, "a refresh")
        refreshed = time.monotonic() - healed
        # On past the moment the lease would have expired had nothing got through.
        holds(same_key, cut + TTL + 1 - time.monotonic(), "the key under its first lease", interval=0.25)
        print(
            f"scenario 13 [silent partition between a registrar and etcd]: noticed_s={noticed:.2f} "
            f"partition_s={healed - cut:.1f} ttl_s={TTL} lease_bound_s={DEFAULTS.lease_bound:g} "
            f"refreshed_after_heal_s={refreshed:.2f}"
        )
        assert noticed <= BOUND + SLACK, f"noticed after {noticed:.2f}s (log {registrar.log_path})"
        assert registrar.alive()
    finally:
        registrar.stop()
        node.stop()
