"""The processes of ``bench.real_vllm``: etcd, ``vllm serve`` under our registrar (wrapper mode), proxy replicas.

Every process listens on 127.0.0.1 (vLLM's KV-event sockets bind every interface when told ``tcp://*:P``, which
is why the checks run in a loopback-only network namespace). Each is stopped when its ``with`` block ends:
a node's registrar gets SIGTERM (it drains, then forwards the signal to vLLM), and whatever is left of the
vLLM process group after a bounded wait is killed. vLLM runs under ``setpriv --pdeathsig TERM``, so it also
stops if its registrar is killed outright.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.procs import HOST, Fleet, Server
from bench.real_vllm_env import RealVllm, server_env
from bench.scale_etcd import etcd_command

MODEL = "tiny-llama"
LORA = "tiny-lora"
TOPIC = "kv"
NODE_START_TIMEOUT = 600.0
"""Seconds for a pair of vLLM servers to start and be routable (20-40 s alone; on 2 busy cores far more)."""
NODE_STOP_TIMEOUT = 60.0
"""Seconds a registrar gets to drain and stop its vLLM after SIGTERM, before the group is killed."""
REGISTRAR_FLAGS = (
    # A starved vLLM answers /health slowly: a generous probe keeps it registered.
    ("--ttl", "30"),
    ("--health-interval", "2"),
    ("--health-timeout", "10"),
    ("--unhealthy-after", "5"),
    ("--drain-timeout", "15"),
)


@dataclass(kw_only=True)
class Node:
    """One ``vllm serve`` under its registrar: its HTTP port and, with events, its PUB and replay endpoints."""

    name: str
    role: str
    server: Server
    events: str | None = None
    replay: str | None = None
    group: int | None = None
    """vLLM's process group (the registrar starts its child in a group of its own)."""

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def node_id(self) -> str:
        return f"{HOST}:{self.server.port}"


@dataclass(kw_only=True)
class NodeSpec:
    name: str
    role: str
    kv_events: bool = False
    lora: bool = False
    kv_transfer_role: str | None = None
    """NixlConnector's kv_role (kv_producer, kv_consumer, kv_both) for a P/D or both node."""
    role_from_child: bool = False
    """No ``--role`` to the registrar: it reads the role from the child's ``kv_role`` (``role`` is what to expect)."""
    extra: Sequence[str] = field(default_factory=tuple)


def start_etcd(fleet: Fleet) -> Server:
    peer = fleet.port()
    etcd = fleet.start(
        "etcd", "", [], "/health", command=lambda port: etcd_command(fleet.log_dir / "etcd-data", port, peer)
    )
    etcd.wait_ready("/health", 30)
    return etcd


def start_proxy(fleet: Fleet, name: str, etcd: Server) -> Server:
    # Load scraped every 2 s, not 0.5: the vLLM servers have little CPU to spare for /metrics.
    proxy = fleet.start(name, "vllm_etcd_proxy.proxy", ["--etcd", etcd.url, "--scrape-load", "2"], "/health")
    proxy.wait_ready("/health", 60)
    return proxy


def _serve_args(env: RealVllm, spec: NodeSpec, port: int, events: tuple[int, int] | None) -> list[str]:
    args = [
        *("serve", str(env.model), "--host", HOST, "--port", str(port), "--served-model-name", MODEL),
        *("--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--max-num-seqs", "8"),
    ]
    if events is not None:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events[0]}",
            "replay_endpoint": f"tcp://*:{events[1]}",
            "topic": TOPIC,
        }
        args += ["--enable-prefix-caching", "--kv-events-config", json.dumps(config)]
    if spec.lora:
        args += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--lora-modules", f"{LORA}={env.lora}"]
    if spec.kv_transfer_role is not None:
        transfer = {"kv_connector": "NixlConnector", "kv_role": spec.kv_transfer_role, "kv_buffer_device": "cpu"}
        args += ["--kv-transfer-config", json.dumps(transfer)]
    return [*args, *spec.extra]


def start_node(fleet: Fleet, env: RealVllm, etcd: Server, spec: NodeSpec) -> Node:
    """Start ``vllm serve`` wrapped by ``vllm-registrar --role ROLE ... -- vllm serve ...``; no wait."""
    events = (fleet.port(), fleet.port()) if spec.kv_events else None
    side_channel = fleet.port()

    def command(port: int) -> list[str]:
        registrar = [sys.executable, "-m", "vllm_etcd_proxy.registrar", "--etcd", etcd.url]
        registrar += [] if spec.role_from_child else ["--role", spec.role]
        registrar += ["--url", f"http://{HOST}:{port}", *(a for pair in REGISTRAR_FLAGS for a in pair)]
        vllm = ["setpriv", "--pdeathsig", "TERM", "--", str(env.vllm), *_serve_args(env, spec, port, events)]
        return [*registrar, "--", *vllm]

    server = fleet.start(spec.name, "", [], "/health", command=command, env=server_env(env, side_channel))
    node = Node(name=spec.name, role=spec.role, server=server)
    if events is not None:
        node.events, node.replay = f"tcp://{HOST}:{events[0]}", f"tcp://{HOST}:{events[1]}"
    return node


def first_child(pid: int) -> int | None:
    """The pid of the first child process of ``pid`` (None when it has none)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
    return None


def _routable(proxy: Server, node: Node) -> bool:
    workers = httpx.get(proxy.url + "/list_workers", timeout=10).json()["workers"]
    return any(
        w["id"] == node.node_id and w["role"] == node.role and w["models_known"] and w["status"] == "serving"
        for w in workers
    )


def wait_routable(proxies: Sequence[Server], nodes: Sequence[Node], timeout: float = NODE_START_TIMEOUT) -> float:
    """Until every proxy lists every node as routable; the seconds it took. Raises with the log's tail when a
    node's registrar exits or time runs out."""
    started = time.monotonic()
    pending = [(p, n) for p in proxies for n in nodes]
    while pending:
        for node in nodes:
            if node.server.popen.poll() is not None:
                raise RuntimeError(f"{node.name} exited with {node.server.popen.returncode}:\n{node.server.log_tail()}")
            if node.group is None:
                node.group = first_child(node.server.pid)
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            pending = [(p, n) for p, n in pending if not _routable(p, n)]
        if time.monotonic() - started > timeout:
            names = ", ".join(sorted({n.name for _, n in pending}))
            raise TimeoutError(f"not routable after {timeout:g} s: {names}:\n{pending[0][1].server.log_tail()}")
        time.sleep(0.5)
    return time.monotonic() - started


def stop_nodes(nodes: Sequence[Node]) -> None:
    """SIGTERM every registrar at once (each drains and stops its vLLM), wait, then kill what is left."""
    for node in nodes:
        if node.group is None:
            node.group = first_child(node.server.pid)
        with contextlib.suppress(ProcessLookupError):
            node.server.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + NODE_STOP_TIMEOUT
    for node in nodes:
        with contextlib.suppress(Exception):
            node.server.popen.wait(max(0.1, deadline - time.monotonic()))
        node.server.stop(timeout=1)
        if node.group is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.group, signal.SIGKILL)  # vLLM's engine process, should one outlive the server


@contextlib.contextmanager
def pair(fleet: Fleet, env: RealVllm, etcd: Server, specs: Sequence[NodeSpec]) -> Iterator[list[Node]]:
    """The nodes of ``specs``, started together; all stopped on leaving, whatever happened."""
    nodes: list[Node] = []
    try:
        for spec in specs:
            nodes.append(start_node(fleet, env, etcd, spec))
        yield nodes
    finally:
        stop_nodes(nodes)
        for node in nodes:
            if node.server in fleet.servers:
                fleet.servers.remove(node.server)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples at ``url`` whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def workers(proxy: Server) -> list[dict[str, Any]]:
    body: list[dict[str, Any]] = httpx.get(proxy.url + "/list_workers", timeout=10).json()["workers"]
    return body
