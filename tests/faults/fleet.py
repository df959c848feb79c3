"""A fleet for fault scenarios: simulated nodes, each under its own registrar process, and proxy replicas.

Nodes and registrars are separate processes (not wrapper mode), so a scenario can kill -9 one or both,
restart a node on the same port, or SIGTERM a registrar and watch it drain. Everything starts in parallel
(this runs on two cores) and ``stop()`` stops everything at once, never raising.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.faults.load import MIXED_MODEL, MODEL
from tests.support.procs import free_port, wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.registrar_proc import Registrar
from tests.support.sim_node import SimNode

PREFIX = "/vllm/default/"
TTL = 3
"""Lease TTL of every registrar: a dead node leaves every pool within ~3 s."""
SIM_KNOBS: dict[str, Any] = {"ttft": 0.02, "itl": 0.01}
REGISTRAR_FLAGS = ("--drain-timeout", "10")
PROXY_FLAGS = (
    "--connect-timeout",
    "1",
    "--prefill-timeout",
    "10",
    "--first-byte-timeout",
    "10",
    "--stream-idle-timeout",
    "10",
    "--shutdown-timeout",
    "20",
)
"""Timeouts far above what the simulated nodes need, far below the defaults (a hang shows up in seconds)."""

Pair = tuple[str, str]
"""(role, node id), the identity of a node in etcd and in a pool."""


@dataclass(frozen=True)
class Etcd:
    """How processes and etcdctl reach etcd. ``endpoint`` may list several URLs (comma-separated); it is
    named like ``EtcdServer.endpoint`` so the test helpers that take an EtcdServer take this too."""

    endpoint: str

    def etcdctl(self, *args: str) -> str:
        done = subprocess.run(
            ["etcdctl", f"--endpoints={self.endpoint}", "--command-timeout=5s", *args],
            capture_output=True,
            text=True,
            timeout=20,
            env={**os.environ, "ETCDCTL_API": "3"},
        )
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def revision(self) -> int:
        return int(
            json.loads(self.etcdctl("get", "/", "--prefix", "--keys-only", "--limit=1", "-w", "json"))["header"][
                "revision"
            ]
        )


@dataclass(eq=False)
class FleetNode:
    role: str
    sim: SimNode
    registrar: Registrar | None = None

    @property
    def name(self) -> str:
        return self.sim.name

    @property
    def node_id(self) -> str:
        return self.sim.host_port

    @property
    def pair(self) -> Pair:
        return (self.role, self.node_id)

    @property
    def key(self) -> str:
        return f"{PREFIX}{self.role}/{self.node_id}"


@dataclass(eq=False)
class Fleet:
    etcd: Etcd
    logs_dir: Path
    ttl: int = TTL
    nodes: list[FleetNode] = field(default_factory=list)
    replicas: list[ProxyProc] = field(default_factory=list)
    _counts: dict[str, int] = field(default_factory=dict)

    # -- starting ------------------------------------------------------------------------------------------

    def start(
        self,
        *,
        prefill: int = 2,
        decode: int = 2,
        mixed: int = 2,
        replicas: int = 2,
        proxy_flags: Sequence[str] = (),
        replica_etcd: Sequence[str] | None = None,
    ) -> Fleet:
        """Nodes, registrars and replicas all at once; returns when every replica routes to every node."""
        nodes = [
            self.node(role)
            for role, count in (("prefill", prefill), ("decode", decode), ("mixed", mixed))
            for _ in range(count)
        ]
        with ThreadPoolExecutor(max_workers=len(nodes) + replicas) as pool:
            started = [pool.submit(self.launch, [node]) for node in nodes]
            self.start_replicas(replicas, proxy_flags, replica_etcd, executor=pool)
            for future in started:
                future.result()
        self.wait_converged()
        return self

    def node(self, role: str, *, knobs: dict[str, Any] | None = None) -> FleetNode:
        """A new node of ``role`` (not started): decode/prefill serve MODEL, mixed nodes serve MIXED_MODEL."""
        self._counts[role] = self._counts.get(role, 0) + 1
        model = MIXED_MODEL if role == "mixed" else MODEL
        sim = SimNode(
            self.logs_dir,
            f"{role}-{self._counts[role]}",
            port=free_port(),
            role=role,
            model=model,
            **{**SIM_KNOBS, **(knobs or {})},
        )
        node = FleetNode(role=role, sim=sim)
        self.nodes.append(node)
        return node

    def launch(self, nodes: Iterable[FleetNode], *, register: bool = True) -> None:
        """Start the nodes' processes and their registrars together; return when the nodes are healthy."""
        nodes = list(nodes)
        if register:
            for node in nodes:
                self.register(node)
        with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
            for future in [pool.submit(node.sim.start) for node in nodes]:
                future.result()

    def register(self, node: FleetNode) -> Registrar:
        node.registrar = Registrar(
            self.etcd,
            node.sim.url,
            self.logs_dir,
            *REGISTRAR_FLAGS,  # type: ignore[arg-type]
            role=node.role,
            ttl=self.ttl,
            name=f"reg-{node.name}",
        )
        return node.registrar

    def start_replicas(
        self,
        count: int,
        flags: Sequence[str] = (),
        etcd: Sequence[str] | None = None,
        executor: ThreadPoolExecutor | None = None,
    ) -> list[ProxyProc]:
        """``count`` replicas; ``etcd[i]`` overrides replica i's --etcd (e.g. a relay you can cut)."""
        first = len(self.replicas)

        def one(i: int) -> ProxyProc:
            endpoint = etcd[i] if etcd is not None else self.etcd.endpoint
            return ProxyProc(self.logs_dir, "--etcd", endpoint, *PROXY_FLAGS, *flags, name=f"proxy-{first + i}")

        if executor is None:
            with ThreadPoolExecutor(max_workers=count) as pool:
                return self.start_replicas(count, flags, etcd, executor=pool)
        started: list[ProxyProc] = []
        errors: list[Exception] = []
        for future in [executor.submit(one, i) for i in range(count)]:
            try:
                started.append(future.result())
            except Exception as exc:  # noqa: BLE001 - keep the ones that started, so stop() stops them
                errors.append(exc)
        self.replicas.extend(started)
        if errors:
            raise errors[0]
        return started

    # -- changing ------------------------------------------------------------------------------------------

    def deregister(self, node: FleetNode, timeout: float = 20.0) -> None:
        """SIGTERM the registrar: it marks the node draining, waits until it is idle, revokes, exits 0."""
        assert node.registrar is not None
        node.registrar.signal(signal.SIGTERM)
        code = node.registrar.wait(timeout)
        node.registrar.stop()
        assert code == 0, f"{node.registrar.name} exited with {code}; see {node.registrar.log_path}"

    def crash(self, node: FleetNode) -> None:
        """kill -9 the registrar and the node together, as a host that loses power."""
        if node.registrar is not None:
            node.registrar.kill()
        node.sim.kill()

    # -- observing -----------------------------------------------------------------------------------------

    def registered(self, via: Etcd | None = None) -> set[Pair]:
        """(role, node id) of every node key under the cluster prefix (asking ``via``, default the fleet's etcd);
        the other folders there (``replicas/``, ``keys/``, ``adapters/``) hold no nodes."""
        keys = (via or self.etcd).etcdctl("get", PREFIX, "--prefix", "--keys-only").split()
        pairs = (key[len(PREFIX) :].split("/", 1) for key in keys)
        return {(p[0], p[1]) for p in pairs if len(p) == 2 and p[0] in ("prefill", "decode", "mixed")}

    @staticmethod
    def pool(replica: ProxyProc, *, routable: bool = False) -> set[Pair]:
        """(role, id) of every node ``replica`` knows (``routable``: only those it would route to)."""
        return {
            (w["role"], w["id"])
            for w in replica.workers()
            if not routable or (w["models_known"] and not w["ejected"] and w["status"] == "serving")
        }

    def pools(self, *, routable: bool = False) -> dict[str, set[Pair]]:
        return {r.proc.name: self.pool(r, routable=routable) for r in self.replicas}

    def wait_converged(
        self, expected: set[Pair] | None = None, timeout: float = 20.0, replicas: Sequence[ProxyProc] | None = None
    ) -> None:
        """Until every replica's pool is ``expected`` (default: the fleet's registered nodes), all routable."""
        if expected is None:
            expected = {n.pair for n in self.nodes if n.registrar is not None and n.registrar.alive()}
        targets = list(replicas or self.replicas)

        def done() -> bool:
            return all(self.pool(r) == expected and self.pool(r, routable=True) == expected for r in targets)

        try:
            wait_until(done, timeout, "every replica's pool to match")
        except TimeoutError as exc:
            pools = {r.proc.name: sorted(self.pool(r)) for r in targets}
            raise AssertionError(
                f"{exc}: expected {sorted(expected)}, pools {pools}, etcd "
                f"{sorted(self.registered())} (logs in {self.logs_dir})"
            ) from None

    def by_id(self, node_id: str | None) -> FleetNode:
        return next(n for n in self.nodes if n.node_id == node_id)

    # -- stopping ------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process at once (registrars revoke their leases); never raises."""
        procs: list[Callable[[], object]] = []
        for node in self.nodes:
            if node.registrar is not None:
                procs.append(node.registrar.stop)
            procs.append(node.sim.stop)
        procs.extend(r.stop for r in self.replicas)
        with ThreadPoolExecutor(max_workers=max(1, len(procs))) as pool:
            for future in [pool.submit(stop) for stop in procs]:
                with contextlib.suppress(Exception):
                    future.result()


def holds(check: Callable[[], bool], duration: float, what: str, interval: float = 0.1) -> None:
    """Assert ``check`` stays true for ``duration`` seconds (for "still there / still ejected" claims)."""
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        assert check(), f"{what} stopped holding"
        time.sleep(interval)


_RESUMED = re.compile(r"stream resumed request_id=(\S+) from=(\S+) to=(\S+) .*? reason=(.*)$", re.MULTILINE)
_BROKEN = re.compile(r"stream broken request_id=(\S+)")


@dataclass(frozen=True, kw_only=True)
class Resume:
    """One "stream resumed" line of a replica's log: the stream went on from node ``source`` at ``target``."""

    replica: str
    request_id: str
    source: str
    target: str
    reason: str


def resumes_logged(replicas: Iterable[ProxyProc]) -> list[Resume]:
    return [
        Resume(replica=r.proc.name, request_id=m[1], source=m[2], target=m[3], reason=m[4])
        for r in replicas
        for m in _RESUMED.finditer(r.proc.log())
    ]


def broken_logged(replicas: Iterable[ProxyProc]) -> set[str]:
    """Request ids of the streams the replicas logged as broken (ended with an error event)."""
    return {m[1] for r in replicas for m in _BROKEN.finditer(r.proc.log())}


def resumes_counted(replicas: Iterable[ProxyProc], outcome: str) -> int:
    """``vllm_proxy_resumes_total{outcome=...}`` summed over ``replicas``."""
    prefix = f'vllm_proxy_resumes_total{{outcome="{outcome}"}} '
    lines = (line for r in replicas for line in r.get("/metrics").text.splitlines())
    return sum(int(float(line[len(prefix) :])) for line in lines if line.startswith(prefix))
