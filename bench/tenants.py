"""A quiet tenant beside a noisy one on a full fleet: the quiet tenant's time to first token, three ways.

    python -m bench.tenants            # about 1.5 min; --quick: about 30 s
    python -m bench.tenants --json

Simulated mixed nodes with ``--max-num-seqs`` (a bounded batch, the rest waits in the node's FIFO queue) behind
one replica whose key file names two tenants (``--policy least-load``: the queue counts the model's free
sequences, and least-load sends a request to the node that has one). The quiet tenant streams at
``--quiet-rps``; the noisy one at ten times that, past what the nodes can serve. Runs, each on a fresh fleet:

- ``solo``: the quiet tenant alone (its time to first token when it has the fleet to itself);
- ``queue-off``: both tenants, the replica forwards everything (the behaviour without ``--queue-timeout``): the
  noisy tenant's backlog sits in the nodes' queues, and every quiet request waits behind it;
- ``queue-on``: both, with ``--max-connections`` = the nodes' batch and ``--queue-timeout``: the backlog waits in
  the replica, tenant by tenant, so a quiet request takes the next free sequence.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.procs import Fleet, add_run_flags, code_version, machine, parse_quick, report_and_exit_status

MODEL = "sim-model"
KEYS = "quiet-key tenant=quiet\nnoisy-key tenant=noisy\n"
QUICK = {"seconds": 8.0}
RUNS = ("solo", "queue-off", "queue-on")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one(client: httpx.AsyncClient, url: str, key: str, tokens: int) -> tuple[str, float | None]:
    """('ok', ttft) for a stream that ended with [DONE]; (status or error, None) otherwise."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    first = None
    try:
        async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as answer:
            if answer.status_code != 200:
                await answer.aread()
                return str(answer.status_code), None
            async for line in answer.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter() - started
                if line == "data: [DONE]":
                    return "ok", first
    except httpx.HTTPError as exc:
        return type(exc).__name__, None
    return "truncated", None


async def tenant(
    url: str, key: str, rps: float, seconds: float, tokens: int, seed: int, results: list[tuple[str, float | None]]
) -> None:
    """Open loop: Poisson arrivals at ``rps`` for ``seconds``, whatever the answers take."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        tasks: list[asyncio.Task[None]] = []

        async def record() -> None:
            results.append(await one(client, url, key, tokens))

        end = time.monotonic() + seconds
        due = time.monotonic()
        while True:
            due += rng.expovariate(rps)
            if due >= end:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(record()))
        await asyncio.gather(*tasks)


def run_once(args: argparse.Namespace, name: str) -> dict[str, Any]:
    with Fleet(keep_logs=args.logs / name if args.logs else None) as fleet:
        key_file = fleet.log_dir / "keys.txt"
        key_file.write_text(KEYS)
        nodes = [
            fleet.start(
                f"node-{i}",
                "vllm_etcd_proxy.sim",
                [
                    "--role",
                    "mixed",
                    "--max-num-seqs",
                    str(args.max_num_seqs),
                    "--ttft",
                    str(args.ttft),
                    "--itl",
                    str(args.itl),
                    "--log-level",
                    "warning",
                ],
                "/health",
            )
            for i in range(args.nodes)
        ]
        fleet.wait_ready()
        flags = [
            "--mixed",
            *(f"127.0.0.1:{n.port}" for n in nodes),
            "--model",
            MODEL,
            "--api-key-file",
            str(key_file),
            "--policy",
            "least-load",
            "--log-level",
            "warning",
        ]
        if name == "queue-on":
            flags += ["--max-connections", str(args.max_num_seqs), "--queue-timeout", str(args.queue_timeout)]
        proxy = fleet.start("proxy", "vllm_etcd_proxy.proxy", flags, "/ready")
        fleet.wait_ready()
        url = f"{proxy.url}/v1/completions"
        quiet: list[tuple[str, float | None]] = []
        noisy: list[tuple[str, float | None]] = []

        async def both() -> None:
            work = [tenant(url, "quiet-key", args.quiet_rps, args.seconds, args.tokens, 1, quiet)]
            if name != "solo":
                work.append(tenant(url, "noisy-key", args.quiet_rps * 10, args.seconds, args.tokens, 2, noisy))
            await asyncio.gather(*work)

        asyncio.run(both())
    ttfts = [t for outcome, t in quiet if outcome == "ok" and t is not None]

    def outcomes(results: list[tuple[str, float | None]]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for outcome, _ in results:
            counts[outcome] = counts.get(outcome, 0) + 1
        return counts

    return {
        "run": name,
        "quiet": outcomes(quiet),
        "noisy": outcomes(noisy),
        "quiet_ttft_ms": {
            "p50": _ms(percentile(ttfts, 0.5)),
            "p99": _ms(percentile(ttfts, 0.99)),
            "mean": _ms(statistics.fmean(ttfts) if ttfts else None),
        },
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    started, load = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), Path("/proc/loadavg").read_text().split()[0]
    runs = {name: run_once(args, name) for name in RUNS}
    solo = runs["solo"]["quiet_ttft_ms"]
    ratios = {
        name: {
            q: (round(r["quiet_ttft_ms"][q] / solo[q], 2) if r["quiet_ttft_ms"][q] and solo[q] else None)
            for q in ("p50", "p99")
        }
        for name, r in runs.items()
        if name != "solo"
    }
    ok = all(r["quiet"].get("ok", 0) == sum(r["quiet"].values()) for r in runs.values())
    capacity = args.nodes * args.max_num_seqs / (args.ttft + args.tokens * args.itl)
    return {
        "ok": ok,
        "code": code_version(),
        "machine": machine(started, load),
        "runs": runs,
        "vs_solo": ratios,
        "config": {k: v for k, v in vars(args).items() if k not in ("logs", "save", "json", "quick")},
        "capacity_rps": round(capacity, 1),
    }


def render(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"{c['nodes']} sim nodes, --max-num-seqs {c['max_num_seqs']}, ttft {c['ttft']} s, {c['tokens']} tokens "
        f"at {c['itl']} s: capacity about {report['capacity_rps']} req/s; quiet {c['quiet_rps']} req/s, noisy "
        f"{c['quiet_rps'] * 10} req/s, {c['seconds']} s per run; code {report['code']}",
        "",
        "| run | quiet TTFT p50 ms | p99 ms | p50 vs solo | p99 vs solo | quiet outcomes | noisy outcomes |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["runs"].items():
        ratio = report["vs_solo"].get(name, {"p50": 1.0, "p99": 1.0})
        lines.append(
            f"| {name} | {r['quiet_ttft_ms']['p50']} | {r['quiet_ttft_ms']['p99']} | {ratio['p50']} | "
            f"{ratio['p99']} | {r['quiet']} | {r['noisy']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tenants", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--nodes", type=int, default=2)
    add("--max-num-seqs", type=int, default=8, help="each node's batch (default 8)")
    add("--ttft", type=float, default=0.5, help="the nodes' seconds to the first token (default 0.5)")
    add("--itl", type=float, default=0.02, help="seconds between tokens (default 0.02)")
    add("--tokens", type=int, default=5, help="tokens per answer (default 5)")
    add("--quiet-rps", type=float, default=3.0, help="the quiet tenant's rate; the noisy one's is 10x (default 3)")
    add("--seconds", type=float, default=20.0, help="seconds of load per run (default 20)")
    add("--queue-timeout", type=float, default=30.0, help="the queue-on run's --queue-timeout (default 30)")
    add_run_flags(parser, QUICK, "a short run")
    args = parse_quick(parser, argv, QUICK)
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    raise SystemExit(main())
