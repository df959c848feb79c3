"""The processes of one routing run: simulated nodes with a prefix cache, then whatever routes to them (proxy
replicas, vllm-router processes, or nothing for direct routing); and what the nodes recorded afterwards.

Every run starts its own nodes, so each router meets cold caches and counters at zero. Everything started
here is stopped when the ``Stack`` is left, also on an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.procs import HOST, Fleet, Server, die_with_parent, free_port
from vllm_etcd_proxy.fleet.vllm import read_node_load

MODEL = "sim-model"
DEFAULT_VLLM_ROUTER = Path.home() / ".cache/vllm-proxy-bench/venv/bin/vllm-router"


@dataclass(frozen=True, kw_only=True)
class NodeTimings:
    """How fast a simulated node is (seconds); ``scaled`` makes a slower one."""

    ttft: float
    itl: float
    prefill_per_token: float
    """Added to ttft per prompt token not in the node's prefix cache."""
    batch_slowdown: float = 0.0
    """Each other running sequence makes a step this fraction longer (vllm-sim --batch-slowdown)."""

    def scaled(self, factor: float) -> NodeTimings:
        return NodeTimings(
            ttft=self.ttft * factor,
            itl=self.itl * factor,
            prefill_per_token=self.prefill_per_token * factor,
            batch_slowdown=self.batch_slowdown,
        )


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    name: str
    """Also the node's --node-id, so the x-sim-node header and /sim/requests name it so."""
    role: str
    """mixed, prefill or decode."""
    timings: NodeTimings


@dataclass(frozen=True, kw_only=True)
class Frontend:
    """What the clients talk to. ``kind``: direct (the nodes themselves), proxy (vllm-proxy replicas) or
    vllm-router; ``replicas`` processes of it, alternated request by request."""

    kind: str
    policy: str = ""
    replicas: int = 1
    extra: tuple[str, ...] = ()
    """More flags for each replica (e.g. --pd-min-prompt-tokens 256)."""


@dataclass(frozen=True, kw_only=True)
class LoadSample:
    """A node's own load as its /metrics showed it: what the proxies' --scrape-load reads too."""

    at: float
    """time.perf_counter() when the answer came."""
    node: str
    running: int
    waiting: int
    kv_usage: float


async def sample_load(nodes: Sequence[tuple[str, str]], into: list[LoadSample], interval: float = 0.1) -> None:
    """Every ``interval`` s, each (name, url) node's running, waiting and KV-cache usage, until cancelled."""
    async with httpx.AsyncClient(timeout=2.0) as client:

        async def one(name: str, url: str) -> None:
            with contextlib.suppress(httpx.HTTPError):
                found = read_node_load((await client.get(url + "/metrics")).content)
                if found is not None:
                    into.append(
                        LoadSample(
                            at=time.perf_counter(), node=name, running=found[0], waiting=found[1], kv_usage=found[2]
                        )
                    )

        while True:
            await asyncio.gather(*(one(name, url) for name, url in nodes))
            await asyncio.sleep(interval)


class Command(Server):
    """A server that is not ``python -m``: any argv (here vllm-router, from its own venv)."""

    def __init__(self, name: str, argv: Sequence[str], port: int, log_dir: Path) -> None:
        self.name = name
        self.port = port
        self.tls = None  # plain HTTP (Server.url and wait_ready read it)
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
                env={**os.environ, "RUST_LOG_STYLE": "never", "NO_COLOR": "1"},
            )


@dataclass(kw_only=True)
class NodeReport:
    """What one node recorded during a run."""

    name: str
    role: str
    queries: int
    """Prompt tokens looked up in the prefix cache (vllm:prefix_cache_queries_total)."""
    hits: int
    """Prompt tokens found there (vllm:prefix_cache_hits_total)."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    """GET /sim/requests records: request_id, prompt_tokens, cached_tokens, status, ..."""


def node_flags(spec: NodeSpec, *, cache_blocks: int, block_size: int, output_len: int) -> list[str]:
    t = spec.timings
    return [
        "--model",
        MODEL,
        "--node-id",
        spec.name,
        "--role",
        spec.role,
        "--ttft",
        f"{t.ttft:g}",
        "--itl",
        f"{t.itl:g}",
        "--prefill-per-token",
        f"{t.prefill_per_token:g}",
        "--batch-slowdown",
        f"{t.batch_slowdown:g}",
        "--cache-blocks",
        str(cache_blocks),
        "--block-size",
        str(block_size),
        "--output-len",
        str(output_len),
        "--max-model-len",
        "16384",
        "--log-level",
        "warning",
    ]


class Stack(contextlib.AbstractContextManager["Stack"]):
    """Nodes plus a frontend, started and ready on entry, all stopped on exit."""

    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        frontend: Frontend,
        *,
        cache_blocks: int,
        block_size: int,
        output_len: int,
        proxy_cpus: set[int] | None,
        vllm_router: Path,
        logs: Path | None,
        scrape_load: float = 0.25,
    ) -> None:
        self._fleet = Fleet(keep_logs=logs)
        self._frontend = frontend
        self._proxy_cpus = proxy_cpus
        self._vllm_router = vllm_router
        self._scrape_load = scrape_load
        self._node_args = {"cache_blocks": cache_blocks, "block_size": block_size, "output_len": output_len}
        self.specs = list(nodes)
        self.nodes: list[Server] = []
        self.frontends: list[Server] = []
        self.pids: dict[str, int] = {}

    def __enter__(self) -> Stack:
        self._fleet.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        fleet, front = self._fleet, self._frontend
        # The nodes publish KV-cache events in every run, as a fleet set up for kv-aware routing would, so that
        # what publishing costs them (CPU on these shared cores) is the same in every row; kv-aware replicas are
        # told where, and route by them.
        kv_flags: list[str] = []
        subscribe = front.kind == "proxy" and front.policy == "kv-aware"
        for spec in self.specs:
            events, replay = f"tcp://{HOST}:{free_port()}", f"tcp://{HOST}:{free_port()}"
            flags = [
                *node_flags(spec, **self._node_args),
                "--kv-events-config",
                json.dumps({"enable_kv_cache_events": True, "endpoint": events, "replay_endpoint": replay}),
                "--tokenizer",
                str(fleet.log_dir / "tokenizer"),
            ]  # the replicas tokenize with it
            node = fleet.start(spec.name, "vllm_etcd_proxy.sim", flags, "/health")
            self.nodes.append(node)
            if subscribe:
                kv_flags += ["--kv-events", f"{HOST}:{node.port}={events},{replay}"]
        fleet.wait_ready()
        if kv_flags:  # the replicas tokenize with the nodes' tokenizer (static nodes given --model have no cards)
            kv_flags += ["--tokenizer", f"{MODEL}={fleet.log_dir / 'tokenizer'}"]
        by_role = {
            role: [f"{HOST}:{n.port}" for n, s in zip(self.nodes, self.specs, strict=True) if s.role == role]
            for role in ("mixed", "prefill", "decode")
        }
        ready: list[tuple[Server, str]] = []
        for i in range(front.replicas if front.kind != "direct" else 0):
            server: Server
            if front.kind == "proxy":
                pools = [arg for role, hosts in by_role.items() if hosts for arg in (f"--{role}", *hosts)]
                args = [
                    *pools,
                    "--model",
                    MODEL,
                    "--log-level",
                    "warning",
                    "--scrape-load",
                    str(self._scrape_load),
                    "--policy",
                    front.policy,
                    *kv_flags,
                    *front.extra,
                ]
                server = fleet.start(f"proxy{i}", "vllm_etcd_proxy.proxy", args, "/ready")
                ready.append((server, "/ready"))
            else:
                port, metrics_port = free_port(), free_port()
                argv = [
                    str(self._vllm_router),
                    "--host",
                    HOST,
                    "--port",
                    str(port),
                    "--worker-urls",
                    *(n.url for n in self.nodes),
                    "--policy",
                    front.policy,
                    "--prometheus-host",
                    HOST,
                    "--prometheus-port",
                    str(metrics_port),
                    "--log-level",
                    "warning",
                    *front.extra,
                ]
                server = Command(f"router{i}", argv, port, fleet.log_dir)
                fleet.servers.append(server)  # stopped with the rest, in reverse order
                ready.append((server, "/health"))
            self.frontends.append(server)
        deadline = time.monotonic() + 30.0
        for server, path in ready:
            server.wait_ready(path, max(0.0, deadline - time.monotonic()))
            if self._proxy_cpus:
                server.pin(self._proxy_cpus)
        self.pids = {s.name: s.pid for s in self._fleet.servers}

    @property
    def named_nodes(self) -> list[tuple[str, str]]:
        """(name, url) of every node."""
        return [(spec.name, node.url) for spec, node in zip(self.specs, self.nodes, strict=True)]

    @property
    def urls(self) -> list[str]:
        """Where clients send: the frontend replicas, or the nodes for direct routing."""
        return [s.url for s in (self.frontends or self.nodes)]

    def node_reports(self) -> list[NodeReport]:
        reports = []
        for node, spec in zip(self.nodes, self.specs, strict=True):
            data = httpx.get(node.url + "/sim/requests", timeout=10.0).json()
            counters = data["counters"]
            reports.append(
                NodeReport(
                    name=spec.name,
                    role=spec.role,
                    queries=int(counters.get("prefix_cache_queries", 0)),
                    hits=int(counters.get("prefix_cache_hits", 0)),
                    requests=list(data["requests"]),
                )
            )
        return reports

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of the nodes and of the frontends."""
        return {"nodes": sum(n.cpu() for n in self.nodes), "frontend": sum(f.cpu() for f in self.frontends)}

    def __exit__(self, *exc: object) -> None:
        # Every server told to stop first, then each waited for: they wind down in parallel.
        for server in self._fleet.servers:
            if server.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    server.popen.send_signal(signal.SIGTERM)
        self._fleet.__exit__(*exc)
