"""What the proxy costs: the same load sent straight to a simulated vLLM node and through ``vllm-proxy``.

    python -m bench.proxy_overhead [--requests 2000] [--concurrency 16] [--stream-tokens 64] [--quick] [--json]

Starts a ``vllm-sim`` node that answers at once (ttft 0, itl 0, so the proxy's own cost dominates), a proxy with
that node as its static mixed pool (no etcd), and, unless --no-disagg, a prefill and a decode node behind a
second proxy. Each scenario runs ``--rounds`` times, direct and proxied phases in ABBA order to cancel drift.
Prints a table (or JSON with --json); exits 1 if any request failed. Every process started here is stopped
at the end, also on Ctrl-C or SIGTERM (and killed by the kernel if this process is killed).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.load import CLIENT_MODES, Generator, Phase, Result, Target, completion_body
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
from bench.report import Scenario, Totals, all_succeeded, headline, render, scenario_summary

MODEL = "sim-model"
QUICK = {
    "requests": 200,
    "concurrency": 8,
    "stream_requests": 40,
    "stream_tokens": 16,
    "serial_requests": 40,
    "rounds": 1,
}


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The two ways to reach the same node(s) for one scenario, and the processes whose CPU counts."""

    direct: Target
    proxied: Target
    proxy: Server
    nodes: tuple[Server, ...]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.proxy_overhead", description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--requests", type=int, default=2000, help="non-streamed requests per phase (default 2000)")
    add("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    add("--tokens", type=int, default=16, help="max_tokens of non-streamed requests (default 16)")
    add("--stream-requests", type=int, default=500, help="streamed requests per phase (default 500)")
    add("--stream-tokens", type=int, default=64, help="tokens (SSE events) per streamed request (default 64)")
    add(
        "--serial-requests",
        type=int,
        default=300,
        help="non-streamed requests at concurrency 1, to see the "
        "latency the proxy adds without queueing (default 300; 0 skips)",
    )
    add("--rounds", type=int, default=2, help="direct/proxy pairs per scenario, in ABBA order (default 2)")
    add("--no-disagg", action="store_true", help="skip the prefill+decode scenarios")
    add("--processes", type=int, default=1, help="load generator processes (default 1)")
    add(
        "--clients",
        choices=CLIENT_MODES,
        default="per-worker",
        help="one httpx client per worker (default) or one shared by all (costs more generator CPU)",
    )
    add("--itl", type=float, default=0.0, help="the node's seconds between tokens (default 0)")
    add(
        "--phase-timeout",
        type=float,
        default=120.0,
        help="seconds per phase before the unfinished requests count as failed (default 120)",
    )
    add_run_flags(p, QUICK, "small numbers for a smoke test")
    args = parse_quick(p, argv, QUICK)
    counts = (
        args.requests,
        args.concurrency,
        args.tokens,
        args.stream_requests,
        args.stream_tokens,
        args.rounds,
        args.processes,
    )
    if min(counts) < 1 or args.serial_requests < 0 or args.processes > args.concurrency:
        p.error("counts must be >= 1 (--serial-requests >= 0) and --processes <= --concurrency")
    return args


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    c = args.concurrency
    found = [
        Scenario(
            key="plain",
            title=f"non-streamed x{args.tokens}",
            topology="mixed",
            stream=False,
            tokens=args.tokens,
            requests=args.requests,
            concurrency=c,
        ),
        Scenario(
            key="stream",
            title=f"streamed x{args.stream_tokens}",
            topology="mixed",
            stream=True,
            tokens=args.stream_tokens,
            requests=args.stream_requests,
            concurrency=c,
        ),
    ]
    if args.serial_requests:
        found.append(
            Scenario(
                key="serial",
                title=f"one at a time x{args.tokens}",
                topology="mixed",
                stream=False,
                tokens=args.tokens,
                requests=args.serial_requests,
                concurrency=1,
            )
        )
    if not args.no_disagg:
        found += [
            Scenario(
                key="disagg-plain",
                title=f"disagg non-str. x{args.tokens}",
                topology="disagg",
                stream=False,
                tokens=args.tokens,
                requests=args.requests // 2,
                concurrency=c,
            ),
            Scenario(
                key="disagg-stream",
                title=f"disagg streamed x{args.stream_tokens}",
                topology="disagg",
                stream=True,
                tokens=args.stream_tokens,
                requests=args.stream_requests,
                concurrency=c,
            ),
        ]
    return found


def start_fleet(fleet: Fleet, args: argparse.Namespace) -> dict[str, Topology]:
    node_flags = [
        "--model",
        MODEL,
        "--ttft",
        "0",
        "--itl",
        str(args.itl),
        "--max-num-seqs",
        "1024",
        "--log-level",
        "warning",
    ]
    proxy_flags = ["--model", MODEL, "--log-level", "warning"]
    node = fleet.start("node", "vllm_etcd_proxy.sim", node_flags, "/health")
    proxy = fleet.start("proxy", "vllm_etcd_proxy.proxy", ["--mixed", f"127.0.0.1:{node.port}", *proxy_flags], "/ready")
    path = "/v1/completions"
    topologies = {
        "mixed": Topology(
            direct=Target(url=node.url + path), proxied=Target(url=proxy.url + path), proxy=proxy, nodes=(node,)
        )
    }
    if not args.no_disagg:
        prefill = fleet.start("prefill", "vllm_etcd_proxy.sim", ["--role", "prefill", *node_flags], "/health")
        decode = fleet.start("decode", "vllm_etcd_proxy.sim", ["--role", "decode", *node_flags], "/health")
        pd_flags = ["--prefill", f"127.0.0.1:{prefill.port}", "--decode", f"127.0.0.1:{decode.port}", *proxy_flags]
        pd_proxy = fleet.start("proxy-disagg", "vllm_etcd_proxy.proxy", pd_flags, "/ready")
        topologies["disagg"] = Topology(
            direct=Target(url=decode.url + path, prefill_url=prefill.url + path),
            proxied=Target(url=pd_proxy.url + path),
            proxy=pd_proxy,
            nodes=(prefill, decode),
        )
    fleet.wait_ready()
    return topologies


def relayed_chunks(proxy: Server) -> int:
    """The proxy's count of body chunks relayed to clients, from its /metrics."""
    for line in httpx.get(proxy.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm_proxy_stream_chunks_total "):
            return int(float(line.split()[1]))
    return 0


class Snapshot:
    """CPU seconds of every process involved and of the whole machine, at one instant."""

    def __init__(self, servers: Sequence[Server]) -> None:
        self.cpu = {s.name: s.cpu() for s in servers}
        self.busy, self.total = machine_cpu_seconds()


def measure(
    generator: Generator, phase: Phase, topology: Topology, servers: Sequence[Server], proxied: bool
) -> tuple[Result, dict[str, Any]]:
    marks: dict[str, Any] = {}

    def on_start() -> None:
        if proxied:
            marks["chunks"] = relayed_chunks(topology.proxy)
        marks["before"] = Snapshot(servers)

    result = generator.run(phase, on_start)
    after = Snapshot(servers)
    before: Snapshot = marks["before"]
    spent = {name: after.cpu[name] - before.cpu[name] for name in after.cpu}
    busy = after.busy - before.busy
    ours = sum(spent.values()) + result.generator_cpu
    figures = {
        "proxy_cpu": spent[topology.proxy.name] if proxied else 0.0,
        "node_cpu": sum(spent[n.name] for n in topology.nodes),
        "other_cpu": max(0.0, busy - ours),
        "busy": busy,
        "total": after.total - before.total,
        "relayed": relayed_chunks(topology.proxy) - marks["chunks"] if proxied else 0,
    }
    return result, figures


def run_scenario(
    scenario: Scenario, topology: Topology, generator: Generator, fleet: Fleet, args: argparse.Namespace
) -> dict[str, Any]:
    """``args.rounds`` direct/proxied pairs, alternating which goes first (ABBA) so that drift cancels."""
    totals = {False: Totals(), True: Totals()}
    for round_no in range(args.rounds):
        for proxied in (False, True) if round_no % 2 == 0 else (True, False):
            phase = Phase(
                target=topology.proxied if proxied else topology.direct,
                body=completion_body(model=MODEL, tokens=scenario.tokens, stream=scenario.stream),
                requests=scenario.requests,
                concurrency=scenario.concurrency,
                clients=args.clients,
                warmup=2 * scenario.concurrency,
                timeout=args.phase_timeout,
            )
            result, figures = measure(generator, phase, topology, fleet.servers, proxied)
            totals[proxied].add(result, **figures)
    return scenario_summary(scenario, totals[False], totals[True])


def run(args: argparse.Namespace) -> dict[str, Any]:
    loadavg_start = Path("/proc/loadavg").read_text().split()[0]
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    summaries = []
    with Fleet(keep_logs=args.logs) as fleet:
        topologies = start_fleet(fleet, args)
        pids = {server.name: server.pid for server in fleet.servers}
        # After the servers: they are started with fork + preexec_fn, which must not happen while threads run.
        generator = Generator(args.processes)
        try:
            for scenario in scenarios(args):
                summaries.append(run_scenario(scenario, topologies[scenario.topology], generator, fleet, args))
        except BaseException:
            generator.close(abort=True)  # before the servers stop: nothing is left sending to them
            raise
        generator.close()
    return {
        "machine": machine(started, loadavg_start),
        "code": code_version(),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "logs")} | {"ttft": 0.0},
        "server_pids": pids,
        "scenarios": summaries,
        "headline": headline(summaries),
        "ok": all_succeeded(summaries),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    sys.exit(main())
