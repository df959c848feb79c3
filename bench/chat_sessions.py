"""What the proxy adds to time to first token under a chat load: sessions straight to the nodes vs through one
replica.

    python -m bench.chat_sessions [--sessions 64] [--turns 6] [--concurrency 16] [--rounds 2] [--quick] [--json]

Starts ``--nodes`` vllm-sim mixed nodes and one vllm-proxy with them as its static mixed pool (no etcd), then
runs the same multi-turn streamed chat workload (bench/sessions.py) ``--rounds`` times each way, in ABBA order:
"direct", each session pinned to one node as a client-side balancer with perfect session affinity would, and
"proxy", every request through the replica. With two CPUs or more, the proxy runs alone on the last one and the
nodes and this load generator share the others. Prints a table (or JSON with --json); exits 1 if any request
failed. Every process started here is stopped at the end, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.chat_report import Phase, render, summarise
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
from bench.sessions import Target, Workload, pinned, round_robin, run_loop, run_sessions

MODEL = "sim-model"
QUICK = {"sessions": 16, "turns": 3, "concurrency": 8, "rounds": 1}
WARMUP_FIRST_SESSION = 1_000_000
"""Warm-up sessions get ids from here on, so their text differs from the measured sessions'."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chat_sessions", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--sessions", type=int, default=64, help="sessions per phase (default 64)")
    add("--turns", type=int, default=6, help="turns per session (default 6)")
    add("--concurrency", type=int, default=16, help="sessions running at once (default 16)")
    add("--rounds", type=int, default=2, help="direct/proxy pairs, in ABBA order (default 2)")
    add("--nodes", type=int, default=4, help="vllm-sim mixed nodes (default 4)")
    add("--ttft", type=float, default=0.02, help="the nodes' seconds to the first token (default 0.02)")
    add("--itl", type=float, default=0.01, help="the nodes' seconds between tokens (default 0.01)")
    add("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    add("--system-words", type=int, default=200, help="words of the shared system preamble (default 200; 0: none)")
    add("--first-words", type=int, default=50, help="words of each session's first message (default 50)")
    add("--followup-words", type=int, default=15, help="words of each later user message (default 15)")
    add("--think", type=float, default=0.0, help="seconds between an answer and the next turn (default 0)")
    add(
        "--ramp",
        type=float,
        help="seconds over which the first sessions start (default: one turn's duration, "
        "ttft + max_tokens x itl, so that requests do not go out in bursts)",
    )
    add("--no-pin", action="store_true", help="leave CPU placement to the scheduler")
    add_run_flags(p, QUICK, "a small run for a smoke test")
    args = parse_quick(p, argv, QUICK)
    if args.ramp is None:
        args.ramp = args.ttft + args.max_tokens * args.itl
    if min(args.sessions, args.turns, args.concurrency, args.rounds, args.nodes, args.max_tokens) < 1:
        p.error("--sessions, --turns, --concurrency, --rounds, --nodes and --max-tokens must be >= 1")
    return args


def placement(pin: bool) -> dict[str, Any]:
    """The proxy on the last CPU, everything else on the others; set for this process now (the nodes inherit
    it), for the proxy once it runs. As ../shared/bench does: the proxy's figures then do not depend on where
    the scheduler puts it, and direct and proxied phases see the same generator and node placement."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        why = "--no-pin" if pin is False else f"only {len(cpus)} CPU"
        return {"pinned": False, "text": f"not pinned ({why}): proxy, nodes and load generator share all CPUs"}
    others, proxy = cpus[:-1], cpus[-1:]
    os.sched_setaffinity(0, others)
    return {
        "pinned": True,
        "proxy_cpus": proxy,
        "other_cpus": others,
        "text": f"proxy pinned to CPU {proxy[0]}; nodes and load generator on CPU {','.join(map(str, others))}",
    }


def start_fleet(fleet: Fleet, args: argparse.Namespace) -> tuple[list[Server], Server]:
    # --output-len = max_tokens: every answer has exactly max_tokens tokens, so both sides stream the same.
    node_flags = [
        "--model",
        MODEL,
        "--ttft",
        str(args.ttft),
        "--itl",
        str(args.itl),
        "--output-len",
        str(args.max_tokens),
        "--log-level",
        "warning",
    ]
    nodes = [fleet.start(f"node{i}", "vllm_etcd_proxy.sim", node_flags, "/health") for i in range(args.nodes)]
    pool = [f"127.0.0.1:{n.port}" for n in nodes]
    proxy = fleet.start(
        "proxy", "vllm_etcd_proxy.proxy", ["--mixed", *pool, "--model", MODEL, "--log-level", "warning"], "/ready"
    )
    fleet.wait_ready()
    return nodes, proxy


def workload(args: argparse.Namespace, **changes: Any) -> Workload:
    fields = {
        "sessions": args.sessions,
        "concurrency": args.concurrency,
        "turns": args.turns,
        "model": MODEL,
        "max_tokens": args.max_tokens,
        "system_words": args.system_words,
        "first_words": args.first_words,
        "followup_words": args.followup_words,
        "think": args.think,
        "ramp": args.ramp,
        "timeout": 30.0,
    }
    return Workload(**(fields | changes))


async def measure(args: argparse.Namespace, nodes: Sequence[Server], proxy: Server) -> list[Phase]:
    """``args.rounds`` direct/proxy pairs, alternating which goes first (ABBA), so that drift cancels."""
    targets: dict[str, Target] = {"direct": pinned([n.url for n in nodes]), "proxy": round_robin([proxy.url])}
    phases: list[Phase] = []
    for round_no in range(args.rounds):
        for side in ("direct", "proxy") if round_no % 2 == 0 else ("proxy", "direct"):
            # Not counted: opens the proxy's connections to the nodes (the nodes close idle ones after 5 s).
            warm = workload(
                args,
                sessions=args.concurrency,
                turns=2,
                ramp=0.0,
                first_session=WARMUP_FIRST_SESSION + len(phases) * args.concurrency,
            )
            await run_sessions(warm, targets[side], lag_interval=0)
            cpu0 = {s.name: s.cpu() for s in (*nodes, proxy)}
            busy0, total0 = machine_cpu_seconds()
            run = await run_sessions(workload(args), targets[side])
            busy1, total1 = machine_cpu_seconds()
            phases.append(
                Phase(
                    side=side,
                    round=round_no,
                    run=run,
                    proxy_cpu=proxy.cpu() - cpu0[proxy.name],
                    node_cpu=sum(n.cpu() - cpu0[n.name] for n in nodes),
                    machine_busy=busy1 - busy0,
                    machine_total=total1 - total0,
                )
            )
    return phases


def run(args: argparse.Namespace) -> dict[str, Any]:
    loadavg_start = Path("/proc/loadavg").read_text().split()[0]
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    where = placement(not args.no_pin)
    with Fleet(keep_logs=args.logs) as fleet:
        nodes, proxy = start_fleet(fleet, args)
        if where["pinned"]:
            proxy.pin(set(where["proxy_cpus"]))
        pids = {server.name: server.pid for server in fleet.servers}
        phases = run_loop(measure(args, nodes, proxy))
    summary = summarise(phases)
    return {
        "machine": machine(started, loadavg_start),
        "code": code_version(),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "logs")},
        "placement": where,
        "server_pids": pids,
        "summary": summary,
        "ok": summary["ok"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    sys.exit(main())
