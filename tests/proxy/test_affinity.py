"""Consistent-hash affinity across replicas that share nothing but the node list."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import Reaper
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode


def test_replicas_send_the_same_session_to_the_same_node(logs_dir: Path, reap: Reaper) -> None:
    sims = [reap(SimNode(logs_dir, f"mixed{i}", role="mixed").start()) for i in range(3)]
    flags = [arg for sim in sims for arg in ("--mixed", sim.host_port)]
    replicas = [reap(ProxyProc(logs_dir, *flags, "--policy", "consistent-hash", name=f"proxy{i}")) for i in range(2)]
    for replica in replicas:
        for sim in sims:
            replica.wait_routable("mixed", sim.host_port)
    homes: dict[str, set[str]] = {}
    for session in range(12):
        for replica in replicas:
            for _ in range(2):
                answer = replica.post(
                    "/v1/completions",
                    json={"model": "sim-model", "prompt": "hi", "max_tokens": 1},
                    headers={"X-Session-Id": f"conversation-{session}"},
                )
                assert answer.status_code == 200
                homes.setdefault(f"conversation-{session}", set()).add(answer.headers["x-sim-node"])
    assert all(len(nodes) == 1 for nodes in homes.values()), homes
    assert len(set.union(*homes.values())) >= 2, "sessions should spread over the nodes"
