"""A real single-member etcd (Debian's etcd-server) on free loopback ports, in a temporary data dir."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.support.procs import HOST, Proc, free_port, http_ok, wait_until


class EtcdServer:
    """Start, kill -9, restart (same data) or wipe a one-member etcd. ``endpoint`` is its client URL."""

    def __init__(self, data_dir: Path, log_dir: Path, name: str = "etcd"):
        if shutil.which("etcd") is None:
            raise RuntimeError("etcd is not installed: apt-get install -y etcd-server etcd-client")
        self.name = name
        self.data_dir = data_dir
        self.log_dir = log_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: Proc | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.client_port}"

    def argv(self) -> list[str]:
        peer = f"http://{HOST}:{self.peer_port}"
        return [
            "etcd",
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"{self.name}={peer}",
            "--log-level",
            "warn",
        ]

    def start(self, timeout: float = 20.0) -> None:
        self.proc = Proc(self.name, self.argv(), self.log_dir)
        wait_until(lambda: http_ok(f"{self.endpoint}/health"), timeout, f"{self.name} healthy")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def wipe(self) -> None:
        """Stop and delete the data dir: the next start() is an etcd that lost everything."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def etcdctl(self, *args: str) -> str:
        argv = ["etcdctl", f"--endpoints={self.endpoint}", *args]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=15, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}
        )
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout
