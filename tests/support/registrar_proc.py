"""``python -m registrar`` as a real process, and reading its key back from etcd with etcdctl."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.etcd_server import EtcdServer
from tests.support.procs import Proc, python_module, wait_until

FAST = ("--health-interval", "0.2", "--health-timeout", "1", "--unhealthy-after", "2", "--etcd-timeout", "2")
"""Flags that make a registrar react within a fraction of a second, for tests."""


@dataclass(frozen=True)
class Entry:
    """One key as etcd holds it: the decoded JSON record and the lease id."""

    record: dict[str, Any]
    lease: int


def read_key(etcd: EtcdServer, key: str) -> Entry | None:
    reply = json.loads(etcd.etcdctl("get", key, "-w", "json"))
    kvs = reply.get("kvs") or []
    if not kvs:
        return None
    value = base64.b64decode(kvs[0].get("value", ""))
    return Entry(record=json.loads(value) if value else {}, lease=int(kvs[0].get("lease", 0)))


def lease_ttl(etcd: EtcdServer, lease: int) -> int:
    """Remaining seconds of a lease, -1 once it is gone."""
    return int(json.loads(etcd.etcdctl("lease", "timetolive", format(lease, "x"), "-w", "json"))["ttl"])


def wait_for_key(etcd: EtcdServer, key: str, timeout: float = 10.0, **expected: Any) -> Entry:
    """Wait until ``key`` exists and its record has the ``expected`` field values; return it."""
    found: list[Entry] = []

    def check() -> bool:
        entry = read_key(etcd, key)
        if entry is None or any(entry.record.get(k) != v for k, v in expected.items()):
            return False
        found.append(entry)
        return True

    wait_until(check, timeout, f"{key} with {expected or 'any value'}")
    return found[-1]


def wait_for_no_key(etcd: EtcdServer, key: str, timeout: float = 10.0) -> None:
    wait_until(lambda: read_key(etcd, key) is None, timeout, f"{key} to be gone")


class Registrar(Proc):
    """A registrar process for the node at ``url``; stdout+stderr (and a wrapped child's) go to its log. ``role``
    None: no ``--role`` (wrapper mode reads it from the child's ``--kv-transfer-config``)."""

    def __init__(
        self,
        etcd: EtcdServer,
        url: str,
        log_dir: Path,
        *flags: str,
        role: str | None = "decode",
        ttl: int = 10,
        command: tuple[str, ...] = (),
        name: str = "registrar",
        env: dict[str, str] | None = None,
    ):
        argv = python_module(
            "vllm_etcd_proxy.registrar",
            "--etcd",
            etcd.endpoint,
            *(("--role", role) if role is not None else ()),
            "--url",
            url,
            "--ttl",
            str(ttl),
            *FAST,
            *flags,
        )
        super().__init__(name, [*argv, *(("--", *command) if command else ())], log_dir, env=env)

    def log(self) -> str:
        """The log so far; readable after stop() too (Proc.log flushes the closed file)."""
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 10.0) -> None:
        wait_until(lambda: text in self.log(), timeout, f"{self.name} to log {text!r}")

    def supervisor_pid(self) -> int:
        """The pid of the wrapped command's supervisor (the registrar's only child process)."""
        return _only_child(self.pid)

    def child_pid(self) -> int:
        """The pid of the wrapped command (the supervisor's only child, see registrar/supervisor.py)."""
        return _only_child(self.supervisor_pid())


def _only_child(pid: int) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def run_registrar(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m registrar ARGS`` to completion, capturing stdout and stderr apart."""
    return subprocess.run(
        [sys.executable, "-m", "vllm_etcd_proxy.registrar", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
