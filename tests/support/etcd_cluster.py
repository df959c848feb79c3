"""A real three-member etcd cluster on loopback, for failover tests (two single-member etcds are not one cluster)."""

from __future__ import annotations

import uuid
from pathlib import Path

from tests.support.etcd_server import EtcdServer
from tests.support.procs import HOST, Proc, http_ok, wait_until


class ClusterMember(EtcdServer):
    """One member; ``initial_cluster`` names all three so they form one raft group."""

    initial_cluster = ""
    cluster_token = ""

    def argv(self) -> list[str]:
        argv = super().argv()
        argv[argv.index("--initial-cluster") + 1] = self.initial_cluster
        return [*argv, "--initial-cluster-token", self.cluster_token, "--initial-cluster-state", "new"]


class EtcdCluster:
    """Start three members together (none is healthy before a quorum exists) and stop them all."""

    def __init__(self, root: Path, log_dir: Path, size: int = 3):
        self.members = [ClusterMember(root / f"m{i}", log_dir, name=f"m{i}") for i in range(size)]
        initial = ",".join(f"{m.name}=http://{HOST}:{m.peer_port}" for m in self.members)
        token = f"test-{uuid.uuid4().hex[:8]}"
        for member in self.members:
            member.initial_cluster, member.cluster_token = initial, token

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(m.endpoint for m in self.members)

    def start(self, timeout: float = 30.0) -> None:
        for member in self.members:
            member.proc = Proc(member.name, member.argv(), member.log_dir)
        urls = [f"{m.endpoint}/health" for m in self.members]
        wait_until(lambda: all(http_ok(url) for url in urls), timeout, "every etcd member healthy")

    def stop(self) -> None:
        for member in self.members:
            member.stop()
