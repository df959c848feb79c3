"""A burst of registrations: how fast every replica sees 10,000 nodes, whether the replicas slow etcd down, and
what an idle replica holding them costs.

    python -m bench.scale [--nodes 10000] [--replicas 4] [--quick] [--json] [--save FILE] [--logs DIR]

One real etcd; nodes are keys pointing at 127.0.0.1 ports where nothing listens (every contact is refused at
once). Three bursts of ``--nodes`` puts (``--parallel`` in flight), each under its own cluster name:
A1 with no replica running, B with ``--replicas`` replicas watching B's cluster, A2 after the replicas stopped.
Figures: the time from B's last put answered until each replica's /status shows every node (it polls every
replica in its own thread); B's duration against the mean of A1 and A2; each replica's CPU over ``--idle``
seconds once it holds every node, and its RSS then against before the burst. Other processes' CPU during each
burst is reported: on a shared machine a burst with others busy is not a fair comparison.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.procs import (
    Fleet,
    Server,
    add_run_flags,
    code_version,
    machine,
    machine_cpu_seconds,
    parse_quick,
    report_and_exit_status,
)
from bench.scale_etcd import Registrations, etcd_command, idle_ports, put_all
from vllm_etcd_proxy.fleet.records import KeyLayout

QUICK = {"nodes": 1000, "replicas": 2, "idle": 3.0, "settle": 1.0}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--parallel", type=int, default=16, help="puts in flight at once (16)")
    p.add_argument("--models", type=int, default=20, help="model names the nodes spread over (20)")
    p.add_argument("--bare-every", type=int, default=10, help="every Nth key is bare, models learned (10; 0: none)")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds to wait for a replica to see all (120)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds after convergence before the idle count (5)")
    p.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU counted (10)")
    p.add_argument(
        "--replica-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for every replica (repeatable), e.g. --replica-arg=--scrape-load=0",
    )
    add_run_flags(p, QUICK, "1,000 nodes and 2 replicas, for CI")
    args = parse_quick(p, argv, QUICK)
    if args.nodes < 1 or args.replicas < 1 or args.parallel < 1 or args.models < 1:
        p.error("--nodes, --replicas, --parallel and --models must be positive")
    return args


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _status(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/status", timeout=30).json()
    return body


def _nodes_seen(status: dict[str, Any]) -> int:
    return sum(int(status[f"{role}_node_count"]) for role in ("prefill", "decode", "mixed"))


def wait_all_seen(
    replicas: Sequence[Server],
    nodes: int,
    revision: int,
    done: float,
    deadline: float,
    results: dict[str, float | None],
) -> None:
    """Fill ``results[name]`` with the seconds from ``done`` until the replica showed ``nodes`` nodes at
    ``revision`` or later (None: not within ``deadline`` s); each replica polled in its own thread."""

    def poll(replica: Server) -> None:
        results[replica.name] = None
        while time.monotonic() < done + deadline:
            status = _status(replica.url)
            if status["discovery"]["revision"] >= revision and _nodes_seen(status) == nodes:
                results[replica.name] = max(0.0, time.monotonic() - done)
                return
            time.sleep(0.02)

    threads = [threading.Thread(target=poll, args=(r,)) for r in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _burst(
    fleet: Fleet, etcd: Server, cluster: str, ports: list[int], args: argparse.Namespace, ours: Sequence[Server]
) -> dict[str, Any]:
    """One burst of puts under ``cluster``; with the CPU the machine spent meanwhile outside ``ours``."""
    regs = Registrations.make(KeyLayout(cluster=cluster), ports, args.models, args.bare_every)
    busy0, total0 = machine_cpu_seconds()
    ours0, bench0, etcd0 = sum(s.cpu() for s in ours), time.process_time(), etcd.cpu()
    burst = put_all(etcd.url, regs, args.parallel)
    busy, total = machine_cpu_seconds()
    ours_cpu = sum(s.cpu() for s in ours) - ours0 + time.process_time() - bench0
    etcd_cpu, bench_cpu = etcd.cpu() - etcd0, time.process_time() - bench0
    others = max(0.0, (busy - busy0) - ours_cpu) / burst.seconds
    return {
        "cluster": cluster,
        "seconds": burst.seconds,
        "failed": burst.failed,
        "last_revision": burst.last_revision,
        "puts_per_s": len(regs.items) / burst.seconds,
        "others_cores": others,
        "etcd_cpu_s": etcd_cpu,
        "putter_cpu_s": bench_cpu,
        "machine_busy": (busy - busy0) / max(1e-9, total - total0),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    loadavg = Path("/proc/loadavg").read_text().split()[0]
    begun = time.monotonic()
    with Fleet(keep_logs=args.logs) as fleet:
        peer = fleet.port()
        etcd = fleet.start(
            "etcd", "", [], "/health", command=lambda port: etcd_command(fleet.log_dir / "etcd-data", port, peer)
        )
        fleet.wait_ready()
        ports = idle_ports(args.nodes)
        a1 = _burst(fleet, etcd, "a1", ports, args, [etcd])
        replica_args = ["--etcd", etcd.url, "--cluster", "b", "--log-level", "warning", *args.replica_arg]
        replicas = [
            fleet.start(f"replica{i}", "vllm_etcd_proxy.proxy", replica_args, "/health") for i in range(args.replicas)
        ]
        fleet.wait_ready()
        for replica in replicas:
            while not _status(replica.url)["discovery"]["synced"]:
                time.sleep(0.05)
        time.sleep(1.0)
        rss_before = {r.name: rss_mb(r.pid) for r in replicas}
        cpu_before = {r.name: r.cpu() for r in replicas}
        b = _burst(fleet, etcd, "b", ports, args, [etcd, *replicas])
        done = time.monotonic()
        seen: dict[str, float | None] = {}
        wait_all_seen(replicas, args.nodes, b["last_revision"], done, args.deadline, seen)
        burst_cpu = {r.name: r.cpu() - cpu_before[r.name] for r in replicas}
        time.sleep(args.settle)
        idle0 = {r.name: r.cpu() for r in replicas}
        time.sleep(args.idle)
        idle = {r.name: (r.cpu() - idle0[r.name]) / args.idle for r in replicas}
        rss_after = {r.name: rss_mb(r.pid) for r in replicas}
        for replica in replicas:
            replica.stop()
        a2 = _burst(fleet, etcd, "a2", ports, args, [etcd])
        pids = {s.name: s.pid for s in fleet.servers}
    times = [t for t in seen.values() if t is not None]
    converged = len(times) == len(seen)
    baseline = statistics.mean([a1["seconds"], a2["seconds"]])
    return {
        "ok": converged and not (a1["failed"] or b["failed"] or a2["failed"]),
        "code": code_version(),
        "machine": machine(started, loadavg),
        "wall_s": time.monotonic() - begun,
        "config": {
            k: getattr(args, k)
            for k in ("nodes", "replicas", "parallel", "models", "bare_every", "idle", "replica_arg")
        },
        "bursts": {"a1": a1, "b": b, "a2": a2},
        "puts_ratio": b["seconds"] / baseline,
        "seen_after_last_put_s": seen,
        "seen_max_s": max(times) if converged else None,
        "burst_cpu_s": burst_cpu,
        "idle_cores": idle,
        "idle_cores_max": max(idle.values()),
        "rss_mb_before": rss_before,
        "rss_mb_after": rss_after,
        "rss_delta_mb_max": max(rss_after[k] - rss_before[k] for k in rss_after),
        "server_pids": pids,
    }


def render(r: dict[str, Any]) -> str:
    c, bursts = r["config"], r["bursts"]
    lines = [
        f"scale: {c['nodes']} nodes (127.0.0.1, nothing listening; every {c['bare_every']}th key bare), "
        f"{c['replicas']} replicas, {c['parallel']} puts in flight; code {r['code']}",
        f"machine: {r['machine']['cpus']} CPUs, {r['machine']['date']}; load average {r['machine']['loadavg_start']} "
        f"at start, {r['machine']['loadavg_end']} at end; {r['wall_s']:.0f} s in all",
    ]
    for name, title in (("a1", "no replica"), ("b", f"{c['replicas']} replicas watching"), ("a2", "no replica")):
        x = bursts[name]
        lines.append(
            f"  burst {name:2} ({title:20}): {x['seconds']:6.2f} s, {x['puts_per_s']:6.0f} puts/s, "
            f"failed {x['failed']}; CPU s: etcd {x['etcd_cpu_s']:.1f}, putter {x['putter_cpu_s']:.1f}; "
            f"others' CPU {x['others_cores']:.2f} cores"
        )
    lines.append(f"puts with replicas / without (mean of a1, a2): {r['puts_ratio']:.2f}   (goal <= 1.20)")
    seen = ", ".join("-" if t is None else f"{t:.2f}" for t in r["seen_after_last_put_s"].values())
    top = "not all within the deadline" if r["seen_max_s"] is None else f"{r['seen_max_s']:.2f} s"
    lines.append(f"every replica sees all nodes after the last put: {top}   (goal < 1 s; each: {seen})")
    burst_cpu = ", ".join(f"{v:.1f}" for v in r["burst_cpu_s"].values())
    lines.append(f"replica CPU from the burst's start to seeing all, s: {burst_cpu}")
    idle = ", ".join(f"{v:.3f}" for v in r["idle_cores"].values())
    lines.append(f"idle replica CPU, cores: {r['idle_cores_max']:.3f} max   (goal < 0.25; each: {idle})")
    deltas = ", ".join(f"{r['rss_mb_before'][k]:.0f}->{v:.0f}" for k, v in r["rss_mb_after"].items())
    lines.append(f"replica RSS growth, MB: {r['rss_delta_mb_max']:.1f} max   (goal < 60; each: {deltas})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    sys.exit(main())
