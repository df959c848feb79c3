"""What a refused request costs the replica: CPU per request it answers 503 (``--max-concurrent-requests``) or 429
(a tenant over its rpm), by the size of the body the client sends.

    python -m bench.shed_cost                                     # this checkout; about 1 min
    python -m bench.shed_cost --build before=../wt-main --build after=.   # two builds, alternated

One ``vllm-sim`` node; per build two replicas: one with ``--max-concurrent-requests 1`` whose one slot a long
stream holds, one with a key file whose tenant's minute is spent. Each round sends ``--requests`` chat completions
(``--concurrency`` at a time, kept-alive connections) with a user message of ``--kib`` KiB, once refused for the
replica's limit and once for the tenant's; builds take turns round by round. The figure is the replica's CPU (all
its threads, schedstat) per refused request, the median of the rounds. A replica that reads, parses and routes the
body before it refuses pays for all of it; one that refuses on the headers pays for the connection's bytes only
(the HTTP parser drops the rest of the body).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.procs import (
    Fleet,
    Server,
    add_run_flags,
    checkout_arg,
    code_version,
    machine,
    parse_quick,
    report_and_exit_status,
)

MODEL = "sim-model"
QUICK = {"requests": 100, "rounds": 2}
KEYS = "spent-key tenant=spent rpm=1\nfree-key tenant=free\n"


async def refused(url: str, key: str, body: dict[str, Any], count: int, concurrency: int) -> tuple[int, int]:
    """``count`` requests, ``concurrency`` at a time; (how many were refused with 503 or 429, how many not)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    auth = {"Authorization": f"Bearer {key}"}
    no, yes = 0, 0
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        queue = iter(range(count))

        async def worker() -> None:
            nonlocal no, yes
            for _ in queue:
                answer = await client.post("/v1/chat/completions", json=body, headers=auth)
                if answer.status_code in (429, 503):
                    no += 1
                else:
                    yes += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return no, yes


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def hold_the_slot(server: Server, stop: threading.Event, held: threading.Event) -> None:
    """A stream that holds the replica's one slot until ``stop``."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1_000_000, "stream": True}
    url = f"{server.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=_auth("free-key"), timeout=600) as answer:
        if answer.status_code != 200:
            return
        for _ in answer.iter_raw():
            held.set()
            if stop.is_set():
                return


def run(args: argparse.Namespace) -> dict[str, Any]:
    started, loadavg = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), Path("/proc/loadavg").read_text().split()[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (args.kib * 1024)}], "max_tokens": 4}
    results: dict[str, dict[str, list[float]]] = {b: {"limit": [], "tenant": []} for b in args.build}
    failed = 0
    with Fleet(keep_logs=args.logs) as fleet:
        keys = fleet.log_dir / "keys.txt"
        keys.write_text(KEYS)
        sim = ["--role", "mixed", "--itl", "0.01", "--output-len", "10000000", "--max-model-len", "2000000"]
        sim += ["--log-level", "warning"]
        node = fleet.start("node", "vllm_etcd_proxy.sim", sim, "/health")
        fleet.wait_ready()
        flags = ["--mixed", f"127.0.0.1:{node.port}", "--model", MODEL, "--log-level", "warning"]
        cases = {"limit": ([*flags, "--max-concurrent-requests", "1"], "free-key"), "tenant": (flags, "spent-key")}
        servers = {
            (build, case): fleet.start(
                f"replica-{build}-{case}",
                "vllm_etcd_proxy.proxy",
                [*extra, "--api-key-file", str(keys)],
                "/ready",
                cwd=path,
            )
            for build, path in args.build.items()
            for case, (extra, _) in cases.items()
        }
        fleet.wait_ready()
        stop = threading.Event()
        for (_, case), server in servers.items():
            if case == "tenant":  # its minute is spent
                spend = {**body, "messages": [{"role": "user", "content": "hi"}]}
                httpx.post(f"{server.url}/v1/chat/completions", json=spend, headers=_auth("spent-key"), timeout=30)
                continue
            held = threading.Event()
            threading.Thread(target=hold_the_slot, args=(server, stop, held), daemon=True).start()
            if not held.wait(30):
                raise TimeoutError(f"{server.name}: the slot holder got no stream")
        try:
            for number in range(args.rounds):
                builds = list(args.build) if number % 2 == 0 else list(reversed(args.build))
                for build in builds:
                    for case, (_, key) in cases.items():
                        server = servers[(build, case)]
                        before = server.cpu()
                        no, yes = asyncio.run(refused(server.url, key, body, args.requests, args.concurrency))
                        spent = server.cpu() - before
                        failed += yes
                        results[build][case].append(spent / max(1, no) * 1e6)
        finally:
            stop.set()
    return {
        "ok": failed == 0,
        "failed": failed,
        "code": code_version(),
        "machine": machine(started, loadavg),
        "config": {
            "kib": args.kib,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "build": {name: str(path) for name, path in args.build.items()},
        },
        "cpu_us_per_refused": {
            build: {case: round(statistics.median(values), 1) for case, values in cases.items()}
            for build, cases in results.items()
        },
        "rounds": results,
    }


def render(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"{c['requests']} requests a round at c={c['concurrency']}, {c['kib']} KiB bodies, {c['rounds']} rounds; "
        f"code {report['code']}",
        "",
        "| build | CPU µs per 503 (the replica's limit) | CPU µs per 429 (the tenant's rpm) |",
        "|---|---|---|",
    ]
    for build, cases in report["cpu_us_per_refused"].items():
        lines.append(f"| {build} | {cases['limit']} | {cases['tenant']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shed_cost", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--build", type=checkout_arg, action="append", help="NAME=CHECKOUT to run a replica from (default: this one)")
    add("--kib", type=int, default=256, help="KiB of the user message in each request (default 256)")
    add("--requests", type=int, default=400, help="requests a round and case (default 400)")
    add("--concurrency", type=int, default=8, help="requests at a time (default 8)")
    add("--rounds", type=int, default=4, help="rounds, every build once each (default 4)")
    add_run_flags(parser, QUICK, "a short run")
    args = parse_quick(parser, argv, QUICK)
    args.build = dict(args.build or [("this", Path(".").resolve())])
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    raise SystemExit(main())
