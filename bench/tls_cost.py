"""What TLS on the replica costs: the same load through a plain-HTTP replica and a TLS one, in one run.

    python -m bench.tls_cost [--requests 2000] [--concurrency 16] [--rounds 2] [--quick] [--json]

One ``vllm-sim`` node that answers at once (ttft 0, itl 0) behind two replicas started alike, one of them with
``--ssl-certfile`` (an EC P-256 certificate made here with openssl, as most certificates are now). Each scenario
runs ``--rounds`` times, plain and TLS phases in ABBA order to cancel drift; the figure is the replica's CPU
(user + system of its process) per request, and its ratio TLS / plain. Scenarios: non-streamed and streamed
requests on kept-alive connections (the handshake is paid once per connection: what an SDK client does), and
non-streamed requests on a new connection each (a handshake per request: what curl in a loop does). Every
process started here is stopped at the end, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime
import ssl
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.load import Generator, Phase, Result, Target, completion_body
from bench.procs import Fleet, Server, add_run_flags, code_version, machine, parse_quick, report_and_exit_status

MODEL = "sim-model"
QUICK = {"requests": 200, "stream_requests": 40, "fresh_requests": 100, "rounds": 1}


@dataclass(frozen=True, kw_only=True)
class Scenario:
    key: str
    title: str
    stream: bool
    tokens: int
    requests: int
    keepalive: bool


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tls_cost", description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--requests", type=int, default=2000, help="non-streamed requests per phase (default 2000)")
    add("--stream-requests", type=int, default=500, help="streamed requests per phase (default 500)")
    add("--fresh-requests", type=int, default=1000, help="requests per phase on a new connection each (default 1000)")
    add("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    add("--tokens", type=int, default=16, help="max_tokens of non-streamed requests (default 16)")
    add("--stream-tokens", type=int, default=64, help="tokens (SSE events) per streamed request (default 64)")
    add("--rounds", type=int, default=2, help="plain/TLS pairs per scenario, in ABBA order (default 2)")
    add("--phase-timeout", type=float, default=120.0, help="seconds per phase (default 120)")
    add_run_flags(p, QUICK, "small numbers for a smoke test")
    args = parse_quick(p, argv, QUICK)
    if min(args.requests, args.stream_requests, args.fresh_requests, args.concurrency, args.rounds) < 1:
        p.error("counts must be >= 1")
    return args


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    return [
        Scenario(
            key="kept",
            title=f"non-streamed x{args.tokens}",
            stream=False,
            tokens=args.tokens,
            requests=args.requests,
            keepalive=True,
        ),
        Scenario(
            key="stream",
            title=f"streamed x{args.stream_tokens}",
            stream=True,
            tokens=args.stream_tokens,
            requests=args.stream_requests,
            keepalive=True,
        ),
        Scenario(
            key="fresh",
            title=f"new connection each, x{args.tokens}",
            stream=False,
            tokens=args.tokens,
            requests=args.fresh_requests,
            keepalive=False,
        ),
    ]


def make_certificate(folder: Path) -> tuple[str, str, str]:
    """(CA bundle, certificate, key) for 127.0.0.1, EC P-256, made with the openssl command."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca_key, ca, key, csr, cert, ext = (
        str(folder / name) for name in ("ca.key", "ca.pem", "r.key", "r.csr", "r.pem", "r.ext")
    )

    def run(*argv: str) -> None:
        subprocess.run(["openssl", *argv], check=True, capture_output=True, timeout=30)

    run("req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=bench-ca")
    Path(ext).write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    run("req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=bench-replica")
    run(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca,
        "-CAkey",
        ca_key,
        "-CAcreateserial",
        "-out",
        cert,
        "-days",
        "1",
        "-extfile",
        ext,
    )
    return ca, cert, key


@dataclass(kw_only=True)
class Totals:
    """One side (plain or TLS) of a scenario, summed over its rounds."""

    ok: int = 0
    failed: int = 0
    proxy_cpu: float = 0.0
    latencies: list[float]

    def add(self, result: Result, cpu: float) -> None:
        self.ok += result.ok
        self.failed += result.failed
        self.proxy_cpu += cpu
        self.latencies += result.latencies

    def figures(self) -> dict[str, Any]:
        ordered = sorted(self.latencies) or [0.0]
        return {
            "ok": self.ok,
            "failed": self.failed,
            "cpu_us_per_request": round(1e6 * self.proxy_cpu / max(1, self.ok), 1),
            "p50_ms": round(1e3 * ordered[len(ordered) // 2], 3),
            "p99_ms": round(1e3 * ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)], 3),
        }


def start_fleet(fleet: Fleet) -> tuple[Server, Server, str]:
    """The node, the plain replica and the TLS replica (alike but for --ssl-*); returns (plain, tls, CA)."""
    ca, cert, key = make_certificate(fleet.log_dir)
    node_flags = ["--model", MODEL, "--ttft", "0", "--itl", "0", "--max-num-seqs", "1024", "--log-level", "warning"]
    node = fleet.start("node", "vllm_etcd_proxy.sim", node_flags, "/health")
    proxy_flags = ["--mixed", f"127.0.0.1:{node.port}", "--model", MODEL, "--log-level", "warning"]
    plain = fleet.start("proxy-plain", "vllm_etcd_proxy.proxy", proxy_flags, "/ready")
    tls_flags = [*proxy_flags, "--ssl-certfile", cert, "--ssl-keyfile", key]
    tls = fleet.start(
        "proxy-tls", "vllm_etcd_proxy.proxy", tls_flags, "/ready", tls=ssl.create_default_context(cafile=ca)
    )
    fleet.wait_ready()
    return plain, tls, ca


def measure(generator: Generator, phase: Phase, server: Server) -> tuple[Result, float]:
    """The phase's result, and the CPU seconds ``server`` spent on its measured part (after the warm-up)."""
    marks: dict[str, float] = {}

    def on_start() -> None:
        marks["cpu"] = server.cpu()

    result = generator.run(phase, on_start)
    return result, server.cpu() - marks["cpu"]


def run_scenario(
    scenario: Scenario, replicas: dict[bool, Server], ca: str, generator: Generator, args: argparse.Namespace
) -> dict[str, Any]:
    totals = {False: Totals(latencies=[]), True: Totals(latencies=[])}
    for round_no in range(args.rounds):
        for tls in (False, True) if round_no % 2 == 0 else (True, False):
            server = replicas[tls]
            target = Target(url=server.url + "/v1/completions", ca_bundle=ca if tls else None)
            phase = Phase(
                target=target,
                body=completion_body(model=MODEL, tokens=scenario.tokens, stream=scenario.stream),
                requests=scenario.requests,
                concurrency=args.concurrency,
                clients="per-worker",
                warmup=2 * args.concurrency,
                timeout=args.phase_timeout,
                keepalive=scenario.keepalive,
            )
            totals[tls].add(*measure(generator, phase, server))
    plain, secure = totals[False].figures(), totals[True].figures()
    return {
        "key": scenario.key,
        "title": scenario.title,
        "plain": plain,
        "tls": secure,
        "cpu_ratio": round(secure["cpu_us_per_request"] / max(0.1, plain["cpu_us_per_request"]), 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    loadavg_start = Path("/proc/loadavg").read_text().split()[0]
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    summaries = []
    with Fleet(keep_logs=args.logs) as fleet:
        plain, tls, ca = start_fleet(fleet)
        generator = Generator(1)
        try:
            for scenario in scenarios(args):
                summaries.append(run_scenario(scenario, {False: plain, True: tls}, ca, generator, args))
        finally:
            generator.close()
    return {
        "machine": machine(started, loadavg_start),
        "code": code_version(),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "logs", "save")},
        "scenarios": summaries,
        "ok": all(s["plain"]["failed"] == 0 and s["tls"]["failed"] == 0 for s in summaries),
    }


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"{m['date']}, code {report['code']}, {m['cpus']} CPUs, load {m['loadavg_start']} -> {m['loadavg_end']}",
        "",
        "| scenario | replica CPU µs/request, plain | TLS | TLS / plain | p50 plain | p50 TLS | p99 plain | p99 TLS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in report["scenarios"]:
        p, t = s["plain"], s["tls"]
        failed = f" ({p['failed']} + {t['failed']} failed)" if p["failed"] or t["failed"] else ""
        lines.append(
            f"| {s['title']}{failed} | {p['cpu_us_per_request']} | {t['cpu_us_per_request']} | {s['cpu_ratio']} "
            f"| {p['p50_ms']} ms | {t['p50_ms']} ms | {p['p99_ms']} ms | {t['p99_ms']} ms |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    sys.exit(main())
