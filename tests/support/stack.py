"""A whole local fleet on loopback: etcd, simulated prefill/decode nodes under registrars, proxy replicas.

    with LocalStack(work_dir, logs_dir, prefill=2, decode=2, proxies=2) as stack:
        stack.proxies[0].url            # http://127.0.0.1:PORT, every replica sees every node
        stack.nodes                     # StackNode: role, url, node_id, engine_id

Each node is ``python -m registrar ... -- python -m sim ...`` (wrapper mode, as a vLLM start script would run
it), so stopping a registrar drains its node in etcd before the node itself stops. ``start()`` returns once
every replica lists every node as routable; ``stop()`` undoes it in reverse order and never raises, so it is
safe in a ``finally``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.etcd_server import EtcdServer
from tests.support.procs import HOST, Proc, free_port, http_ok, python_module, wait_until

logger = logging.getLogger(__name__)

REGISTRAR_FLAGS = ("--ttl", "10", "--health-interval", "0.5", "--drain-timeout", "10")
"""Registrar flags for a local stack: default TTL, but a node shows up within half a second of being healthy."""

STOP_TIMEOUT = 15.0
"""Seconds a process gets after SIGTERM before SIGKILL (a registrar drains first, then stops its node)."""


@dataclass
class StackNode:
    """One simulated node and the registrar that runs it. ``node_id`` is also the last segment of its etcd key."""

    role: str
    port: int
    proc: Proc
    engine_id: str = ""
    """The NIXL engine id the node announces in its prefill responses (read from ``/sim/config`` at start)."""

    @property
    def node_id(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.node_id}"

    @property
    def name(self) -> str:
        return self.proc.name


@dataclass
class StackProxy:
    """One ``vllm-proxy`` replica."""

    port: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def name(self) -> str:
        return self.proc.name

    def workers(self) -> list[dict[str, Any]]:
        body: list[dict[str, Any]] = httpx.get(f"{self.url}/list_workers", timeout=5).json()["workers"]
        return body

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{self.url}/status", timeout=5).json()
        return body


@dataclass
class LocalStack:
    """etcd + ``prefill``, ``decode`` and ``both`` simulated nodes (each under a registrar) + ``replicas`` proxies."""

    work_dir: Path
    """Scratch space (etcd's data dir goes here); created if missing."""
    log_dir: Path
    """One ``NAME.log`` per process."""
    prefill: int = 2
    decode: int = 2
    both: int = 0
    replicas: int = 2
    model: str = "sim-model"
    sim_flags: tuple[str, ...] = ()
    """Extra ``vllm-sim`` flags for every node (e.g. ``("--ttft", "0.1")``)."""
    registrar_flags: tuple[str, ...] = REGISTRAR_FLAGS
    proxy_flags: tuple[str, ...] = ()
    etcd: EtcdServer | None = None
    nodes: list[StackNode] = field(default_factory=list)
    proxies: list[StackProxy] = field(default_factory=list)

    @property
    def etcd_endpoint(self) -> str:
        assert self.etcd is not None, "stack not started"
        return self.etcd.endpoint

    def start(self, timeout: float = 30.0) -> LocalStack:
        """Start everything and wait until every replica routes to every node; on failure stop what started."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.etcd = EtcdServer(self.work_dir / "etcd-data", self.log_dir)
        self.etcd.start()
        # Nodes and replicas start together: the replicas pick the nodes up from the watch as they register.
        for role, count in (("prefill", self.prefill), ("decode", self.decode), ("both", self.both)):
            for i in range(1, count + 1):
                self.nodes.append(self._start_node(role, f"{role}-{i}"))
        for i in range(1, self.replicas + 1):
            self.proxies.append(self._start_proxy(f"proxy-{i}"))
        self.wait_routable(timeout)
        for node in self.nodes:
            node.engine_id = str(httpx.get(f"{node.url}/sim/config", timeout=5).json()["engine_id"])

    def _start_node(self, role: str, name: str) -> StackNode:
        port = free_port()
        url = f"http://{HOST}:{port}"
        sim = python_module(
            "vllm_etcd_proxy.sim",
            "--host",
            HOST,
            "--port",
            str(port),
            "--role",
            role,
            "--model",
            self.model,
            *self.sim_flags,
        )
        argv = python_module(
            "vllm_etcd_proxy.registrar",
            "--etcd",
            self.etcd_endpoint,
            "--role",
            role,
            "--url",
            url,
            "--models",
            "auto",
            "--label",
            f"name={name}",
            *self.registrar_flags,
            "--",
            *sim,
        )
        return StackNode(role=role, port=port, proc=Proc(name, argv, self.log_dir))

    def _start_proxy(self, name: str) -> StackProxy:
        port = free_port()
        argv = python_module(
            "vllm_etcd_proxy.proxy",
            "--host",
            HOST,
            "--port",
            str(port),
            "--etcd",
            self.etcd_endpoint,
            *self.proxy_flags,
        )
        return StackProxy(port=port, proc=Proc(name, argv, self.log_dir))

    def missing(self) -> dict[str, list[str]]:
        """For each replica, the nodes it does not (yet) route to; empty when the stack is ready."""
        wanted = {(n.role, n.node_id) for n in self.nodes}
        gaps: dict[str, list[str]] = {}
        for proxy in self.proxies:
            try:
                routable = {
                    (w["role"], w["id"])
                    for w in proxy.workers()
                    if w["models_known"] and not w["ejected"] and w["status"] == "serving"
                }
            except (httpx.HTTPError, ValueError, KeyError):
                routable = set()
            lacking = sorted(f"{role}/{node_id}" for role, node_id in wanted - routable)
            if lacking:
                gaps[proxy.name] = lacking
        return gaps

    def wait_routable(self, timeout: float = 30.0) -> None:
        """Until every replica lists every node as routable; a process that died fails at once with its log."""

        dead: list[str] = []

        def ready() -> bool:
            dead[:] = self._dead()
            return bool(dead) or (all(http_ok(f"{p.url}/ready") for p in self.proxies) and not self.missing())

        try:
            wait_until(ready, timeout, "every replica to route to every node")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; still missing: {self.missing()} (logs in {self.log_dir})") from None
        if dead:
            raise RuntimeError("\n".join(dead))

    def _dead(self) -> list[str]:
        """One report (exit code and the end of its log) per process that has exited."""
        reports = []
        for proc in [*(n.proc for n in self.nodes), *(p.proc for p in self.proxies)]:
            if not proc.alive():
                tail = "\n".join(proc.log().splitlines()[-20:])
                reports.append(f"{proc.name} exited with {proc.popen.returncode}; end of {proc.log_path}:\n{tail}")
        return reports

    def stop(self) -> None:
        """Registrars first (all at once: each drains, deregisters, then stops its node), then replicas, then
        etcd. Never raises."""
        for group in ([n.proc for n in self.nodes], [p.proc for p in self.proxies]):
            children = {proc.name: _children(proc) for proc in group}
            for proc in group:
                proc.signal(signal.SIGTERM)
            for proc in group:
                try:
                    code = proc.stop(STOP_TIMEOUT)
                except (OSError, subprocess.SubprocessError) as exc:
                    logger.warning("stopping %s failed: %s", proc.name, exc)
                    code = -signal.SIGKILL
                if code == -signal.SIGKILL:  # a registrar killed after the timeout left its node behind
                    for pid in children[proc.name]:
                        _kill(pid)
        self.nodes.clear()
        self.proxies.clear()
        if self.etcd is not None:
            self.etcd.stop()
            shutil.rmtree(self.etcd.data_dir, ignore_errors=True)
            self.etcd = None

    def __enter__(self) -> LocalStack:
        return self.start() if self.etcd is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _children(proc: Proc) -> list[int]:
    try:
        return [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    except OSError:
        return []


def _kill(pid: int) -> None:
    try:
        if os.getpgid(pid) == pid:  # a registrar's supervisor leads its node's group: the node goes too, at once
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:  # already gone: the usual case
        pass
