"""How soon a replica started beside busy nodes routes on what they already cache (KV-event replay).

    python -m bench.kv_late_replica [--nodes 3] [--prompts 6] [--runs 5] [--frames 4] [--quick] [--json]

``--nodes`` vllm-sim nodes publish KV-cache events (``--kv-replay-frames``: 4 answers replays as vLLM 0.32, 3 as
older vLLM) and each caches ``--prompts`` token-id prompts sent straight to it. Then, ``--runs`` times, a new
vllm-proxy replica is started with those nodes (``--mixed`` and ``--kv-events``) and, from the moment its process
is spawned, gets one next turn of a cached prompt at a time as soon as it listens. Reported per run: seconds from
spawn to listening (/health), to ready (/ready, which waits for the nodes' first replays), and to the first request
decided on a cached prefix (its /metrics counter), and how many next turns went to the node holding their prefix.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import httpx

from bench.procs import HOST, Fleet, Server, add_run_flags, code_version, parse_quick, report_and_exit_status

MODEL = "sim-model"
BLOCK = 16
QUICK = {"nodes": 2, "prompts": 2, "runs": 1}
DECISIONS = "vllm_proxy_kv_routing_decisions_total"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_late_replica", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3, help="vllm-sim nodes publishing events (3)")
    p.add_argument("--prompts", type=int, default=6, help="prompts cached on each node before a replica starts (6)")
    p.add_argument("--runs", type=int, default=5, help="replicas started one after another (5)")
    p.add_argument("--frames", type=int, choices=(3, 4), default=4, help="the nodes' replay answers (4: vLLM 0.32)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds a replica gets to route on the index (20)")
    add_run_flags(p, QUICK, "a smoke run")
    args = parse_quick(p, argv, QUICK)
    if min(args.nodes, args.prompts, args.runs) < 1:
        p.error("--nodes, --prompts and --runs must be at least 1")
    return args


def prompt(node: int, i: int) -> list[int]:
    """Three full blocks of ids of their own (the simulator's vocabulary is 32,768 ids)."""
    start = 1000 + (node * 100 + i) * 3 * BLOCK
    return list(range(start, start + 3 * BLOCK))


def complete(client: httpx.Client, url: str, ids: list[int]) -> httpx.Response:
    return client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1})


def cached_decisions(client: httpx.Client, url: str) -> float:
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith(DECISIONS + "{") and 'reason="cached_prefix"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(client: httpx.Client, url: str, deadline: float) -> bool:
    """Until GET ``url`` answers 200 (polled every 10 ms); False when ``deadline`` passes first."""
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if client.get(url).status_code == 200:
                return True
        time.sleep(0.01)
    return False


def late_replica(
    fleet: Fleet, args: argparse.Namespace, nodes: list[Server], kv_flags: list[str], run: int
) -> dict[str, Any]:
    """One replica's start, as an L4 balancer would use it (traffic once /ready says so): the times from spawn,
    and where its next turns went."""
    pool = ["--mixed", *(f"{HOST}:{n.port}" for n in nodes)]
    spawned = time.monotonic()
    replica = fleet.start(f"replica{run}", "vllm_etcd_proxy.proxy", [*pool, *kv_flags, "--scrape-load", "0"], "/health")
    deadline = spawned + args.timeout
    found: dict[str, Any] = {
        "listening": None,
        "ready": None,
        "first_indexed": None,
        "on_their_node": 0,
        "next_turns": 0,
    }
    with httpx.Client(timeout=10.0) as client:
        if wait_for(client, f"{replica.url}/health", deadline):
            found["listening"] = time.monotonic() - spawned
        if wait_for(client, f"{replica.url}/ready", deadline):
            found["ready"] = time.monotonic() - spawned
            turns = [(n, node, i) for n, node in enumerate(nodes) for i in range(args.prompts)]
            for count, (n, node, i) in enumerate(turns):
                answer = complete(client, replica.url, [*prompt(n, i), 7, run])
                found["on_their_node"] += answer.headers.get("x-sim-node") == f"{HOST}:{node.port}"
                if count == 0 and cached_decisions(client, replica.url) > 0:
                    found["first_indexed"] = time.monotonic() - spawned
            found["next_turns"] = len(turns)
    replica.stop()
    return found


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with Fleet(args.logs) as fleet:
        nodes, kv_flags = [], []
        for n in range(args.nodes):
            events, replay = f"tcp://{HOST}:{fleet.port()}", f"tcp://{HOST}:{fleet.port()}"
            config = {"enable_kv_cache_events": True, "endpoint": events, "replay_endpoint": replay, "topic": "kv"}
            flags = ["--block-size", str(BLOCK), "--output-len", "1", "--ttft", "0", "--itl", "0"]
            flags += ["--kv-events-config", json.dumps(config), "--kv-replay-frames", str(args.frames)]
            nodes.append(fleet.start(f"node{n}", "vllm_etcd_proxy.sim", flags, "/health"))
            kv_flags += ["--kv-events", f"{HOST}:{nodes[-1].port}={events},{replay}"]
        fleet.wait_ready()
        with httpx.Client(timeout=10.0) as client:
            for n, node in enumerate(nodes):
                for i in range(args.prompts):
                    complete(client, node.url, [*prompt(n, i), 1]).raise_for_status()
        runs = [late_replica(fleet, args, nodes, kv_flags, run) for run in range(args.runs)]
    ok = all(r["first_indexed"] is not None for r in runs)
    summary = {
        key: statistics.median(r[key] for r in runs) if ok else None for key in ("listening", "ready", "first_indexed")
    }
    return {
        "ok": ok,
        "code": code_version(),
        "config": vars(args) | {"logs": None, "save": None},
        "runs": runs,
        "median": summary,
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        f"code {report['code']}, replay frames {report['config']['frames']}",
        "run  listening  ready  first indexed  next turns on their node",
    ]
    for i, r in enumerate(report["runs"]):
        cells = [f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("listening", "ready", "first_indexed")]
        lines.append(f"{i:>3}  {cells[0]:>9}  {cells[1]:>5}  {cells[2]:>13}  {r['on_their_node']}/{r['next_turns']}")
    m = report["median"]
    if report["ok"]:
        times = ", ".join(f"{k.replace('_', ' ')} {m[k]:.3f} s" for k in ("listening", "ready", "first_indexed"))
        lines.append(f"median: {times}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return report_and_exit_status(lambda: measure(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    raise SystemExit(main())
