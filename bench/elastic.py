"""Elastic prefill/decode: goodput of three layouts of the same 4 simulated nodes under the same shifting load.

    python -m bench.elastic [--phase-seconds 120] [--layouts pd,mixed,both] [--quick] [--json] [--save FILE]

Layouts: ``pd`` (2 prefill + 2 decode nodes, the proxy's ``--pd-min-prompt-tokens`` at the same 256 as the both
layout's ``--split-min-prompt-tokens``, so short prompts skip the prefill leg there too), ``mixed`` (4 mixed
nodes), ``both`` (4 both nodes: the replicas pick per request, routing/elastic.py). Every layout gets the same
nodes (vllm-sim with the same per-token prefill cost, chunked prefill and batch slowdown) behind the same number
of replicas, and the very same requests at the very same times: one seeded open-loop schedule (Poisson arrivals)
in three phases back to back, as traffic shifts through a day:

- prompt-heavy: long prompts, short answers (RAG, classification, agents reading files);
- decode-heavy: short prompts, long answers;
- mixed: long prompts and long answers.

Each request is a streamed completion with a prompt of unique words (no prefix cache helps) and ``ignore_eos``.
A request is good when its time to first token is within ``--ttft-target`` and its mean time between tokens
within ``--tpot-target``; goodput is good requests per second of the phase they arrived in. The report gives
per layout and phase the requests, the good ones, goodput and TTFT / TPOT percentiles; for the both layout also
how many requests ran on one node or were split, and per node the legs it took (prefill, decode, whole); and the
verdicts: both / best fixed layout per phase, and both / worse fixed layout over the whole run. Exits 1 if a
request failed outright (an error, not a slow answer). Every process started here is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.procs import Fleet, code_version, machine, report_and_exit_status

MODEL = "sim-model"
LAYOUTS = {"pd": ("prefill", "prefill", "decode", "decode"), "mixed": ("mixed",) * 4, "both": ("both",) * 4}
LEG_KINDS = ("prefill", "decode", "whole")
SPLIT_TOKENS = 256
"""The both layout's --split-min-prompt-tokens and the pd layout's --pd-min-prompt-tokens."""


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    rate: float
    """Requests per second (Poisson arrivals)."""
    prompt_words: int
    """Prompt length (vllm-sim's word tokenizer: one word, one token)."""
    answer_tokens: int


PHASES = (
    PhaseSpec("prompt-heavy", 3.0, 1500, 16),
    PhaseSpec("decode-heavy", 6.0, 40, 200),
    PhaseSpec("mixed", 3.0, 1000, 100),
)
QUICK = {"phase_seconds": 6.0, "load_scale": 0.5}


@dataclass(frozen=True)
class Planned:
    at: float
    """Seconds from the start of the run."""
    phase: int
    prompt: str
    answer_tokens: int


@dataclass
class Outcome:
    phase: int
    ttft: float | None = None
    tpot: float | None = None
    error: str | None = None


def schedule(args: argparse.Namespace) -> list[Planned]:
    """The run's requests: Poisson arrivals per phase, seeded, the same for every layout."""
    rng = random.Random(args.seed)
    planned: list[Planned] = []
    for index, spec in enumerate(PHASES):
        start, end = index * args.phase_seconds, (index + 1) * args.phase_seconds
        at = start + rng.expovariate(spec.rate * args.load_scale)
        while at < end:
            n = len(planned)
            prompt = " ".join(f"r{n}w{j}" for j in range(spec.prompt_words))
            planned.append(Planned(at=at, phase=index, prompt=prompt, answer_tokens=spec.answer_tokens))
            at += rng.expovariate(spec.rate * args.load_scale)
    return planned


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    if not ordered:
        return {"p50": None, "p90": None, "p99": None}

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


async def one_request(client: httpx.AsyncClient, url: str, planned: Planned, timeout: float) -> Outcome:
    """A streamed completion: seconds to its first token and mean seconds between its tokens."""
    body = {
        "model": MODEL,
        "prompt": planned.prompt,
        "max_tokens": planned.answer_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    outcome = Outcome(planned.phase)
    sent = time.monotonic()
    first = last = 0.0
    tokens = 0
    try:
        async with asyncio.timeout(timeout), client.stream("POST", f"{url}/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                outcome.error = f"status {answer.status_code}"
                return outcome
            buffer = b""
            async for chunk in answer.aiter_raw():
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if event.startswith(b'data: {"error"'):
                        outcome.error = "error event"
                        return outcome
                    if event.startswith(b"data: {"):
                        last = time.monotonic()
                        first = first or last
                        tokens += 1
    except TimeoutError:
        outcome.error = "timeout"
        return outcome
    except httpx.HTTPError as exc:
        outcome.error = type(exc).__name__
        return outcome
    if tokens < planned.answer_tokens:
        outcome.error = f"{tokens} tokens of {planned.answer_tokens}"
        return outcome
    outcome.ttft = first - sent
    outcome.tpot = (last - first) / max(1, tokens - 1)
    return outcome


_SAMPLE = re.compile(r"^(vllm_proxy_legs_total|vllm_proxy_elastic_requests_total)\{([^}]*)\} (\S+)$", re.M)


def counters(replicas: Sequence[str]) -> dict[str, float]:
    """Legs per node and kind, and elastic decisions, summed over the replicas' /metrics."""
    found: dict[str, float] = {}
    for url in replicas:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for name, labels, value in _SAMPLE.findall(text):
            key = f"{name}{{{labels}}}"
            found[key] = found.get(key, 0.0) + float(value)
    return found


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def start_layout(fleet: Fleet, layout: str, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The layout's nodes and replicas; returns the replicas' URLs and node id -> role."""
    physics = [
        "--ttft",
        str(args.ttft),
        "--itl",
        str(args.itl),
        "--prefill-per-token",
        str(args.prefill_per_token),
        "--prefill-chunk",
        str(args.prefill_chunk),
        "--batch-slowdown",
        str(args.batch_slowdown),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--cache-blocks",
        "0",
        "--max-model-len",
        "8192",
    ]
    nodes = [
        fleet.start(f"{layout}-{i}-{role}", "vllm_etcd_proxy.sim", ["--role", role, *physics], "/health")
        for i, role in enumerate(LAYOUTS[layout])
    ]
    roles = {f"127.0.0.1:{n.port}": role for n, role in zip(nodes, LAYOUTS[layout], strict=True)}
    flags: list[str] = ["--scrape-load", str(args.scrape_load), "--model", MODEL]
    for node_id, role in roles.items():
        flags += [f"--{role}", node_id]
    flags += ["--split-min-prompt-tokens", str(SPLIT_TOKENS)]
    if layout == "pd":
        flags += ["--pd-min-prompt-tokens", str(SPLIT_TOKENS)]
    replicas = [
        fleet.start(f"{layout}-replica{i}", "vllm_etcd_proxy.proxy", flags, "/ready") for i in range(args.replicas)
    ]
    fleet.wait_ready(60)
    return [r.url for r in replicas], roles


async def drive(replicas: Sequence[str], planned: Sequence[Planned], args: argparse.Namespace) -> list[Outcome]:
    """Send every planned request at its time, through the replicas in turn; wait for all of them."""
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=400)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        warm = [one_request(client, url, Planned(0, 0, "warm up", 2), 30) for url in replicas]
        await asyncio.gather(*warm)
        start = time.monotonic()
        tasks = []
        for i, p in enumerate(planned):
            delay = start + p.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            url = replicas[i % len(replicas)]
            tasks.append(asyncio.create_task(one_request(client, url, p, args.request_timeout)))
        return list(await asyncio.gather(*tasks))


async def drive_with_counters(
    replicas: Sequence[str], planned: Sequence[Planned], args: argparse.Namespace
) -> tuple[list[Outcome], list[dict[str, float]]]:
    """``drive``, reading the replicas' counters at every phase boundary (while the load runs)."""
    readings: list[dict[str, float]] = []

    async def sample() -> None:
        begin = time.monotonic()
        for index in range(len(PHASES) + 1):
            await asyncio.sleep(max(0.0, begin + index * args.phase_seconds - time.monotonic()))
            readings.append(await asyncio.to_thread(counters, replicas))

    sampler = asyncio.create_task(sample())
    outcomes = await drive(replicas, planned, args)
    await sampler
    return outcomes, readings


def summarise(outcomes: Sequence[Outcome], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for index, spec in enumerate(PHASES):
        mine = [o for o in outcomes if o.phase == index]
        done = [o for o in mine if o.error is None]
        good = [
            o
            for o in done
            if o.ttft is not None and o.tpot is not None and o.ttft <= args.ttft_target and o.tpot <= args.tpot_target
        ]
        errors: dict[str, int] = {}
        for o in mine:
            if o.error is not None:
                errors[o.error] = errors.get(o.error, 0) + 1
        rows.append(
            {
                "phase": spec.name,
                "requests": len(mine),
                "ok": len(done),
                "good": len(good),
                "goodput": round(len(good) / args.phase_seconds, 3),
                "ttft_ms": percentiles([o.ttft for o in done if o.ttft is not None]),
                "tpot_ms": percentiles([o.tpot for o in done if o.tpot is not None]),
                "errors": errors,
            }
        )
    return rows


def work_by_phase(readings: Sequence[dict[str, float]], roles: dict[str, str]) -> list[dict[str, Any]]:
    """Per phase: requests run local / split, and the legs each node took by kind."""
    phases = []
    for index, spec in enumerate(PHASES):
        changed = delta(readings[index + 1], readings[index])
        decisions: dict[str, float] = {}
        legs: dict[str, dict[str, float]] = {}
        for key, value in changed.items():
            labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
            if key.startswith("vllm_proxy_elastic_requests_total"):
                decisions[f"{labels['decision']}/{labels['reason']}"] = value
            elif labels.get("node") in roles:
                legs.setdefault(labels["node"], {})[labels["leg"]] = value
        phases.append({"phase": spec.name, "decisions": decisions, "legs_by_node": legs})
    return phases


def run_layout(layout: str, planned: Sequence[Planned], args: argparse.Namespace) -> dict[str, Any]:
    with Fleet(args.logs / layout if args.logs else None) as fleet:
        replicas, roles = start_layout(fleet, layout, args)
        outcomes, readings = asyncio.run(drive_with_counters(replicas, planned, args))
    return {
        "layout": layout,
        "nodes": sorted(roles.values()),
        "phases": summarise(outcomes, args),
        "work": work_by_phase(readings, roles),
    }


def verdicts(layouts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """both / best fixed layout per phase; both / worse fixed layout over the run."""
    by = {row["layout"]: row for row in layouts}
    if "both" not in by or not {"pd", "mixed"} <= set(by):
        return {}

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 2) if b else None

    per_phase = {}
    for index, spec in enumerate(PHASES):
        best = max(by[name]["phases"][index]["goodput"] for name in ("pd", "mixed"))
        per_phase[spec.name] = ratio(by["both"]["phases"][index]["goodput"], best)
    total = {name: sum(p["good"] for p in row["phases"]) for name, row in by.items()}
    worse = min(total["pd"], total["mixed"])
    return {
        "both_vs_best_fixed_by_phase": per_phase,
        "both_vs_worse_fixed_over_the_run": ratio(total["both"], worse),
        "good_requests_over_the_run": total,
        "targets": {"every_phase_at_least_best_fixed": 1.0, "run_vs_worse_fixed": 1.3},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    loadavg = Path("/proc/loadavg").read_text().split()[0]
    planned = schedule(args)
    layouts = [run_layout(layout, planned, args) for layout in args.layouts]
    failed = sum(n for row in layouts for p in row["phases"] for e, n in p["errors"].items() if e != "timeout")
    return {
        "ok": failed == 0,
        "failed_requests": failed,
        "config": {
            key: getattr(args, key)
            for key in (
                "phase_seconds",
                "load_scale",
                "replicas",
                "ttft_target",
                "tpot_target",
                "ttft",
                "itl",
                "prefill_per_token",
                "prefill_chunk",
                "batch_slowdown",
                "max_num_seqs",
                "scrape_load",
                "seed",
            )
        }
        | {"phases": [vars(spec) | {"rate": spec.rate * args.load_scale} for spec in PHASES], "code": code_version()},
        "machine": machine(started, loadavg),
        "layouts": layouts,
        "verdicts": verdicts(layouts),
    }


def _triple(figures: dict[str, float | None]) -> str:
    return "/".join("-" if v is None else f"{v:g}" for v in figures.values())


def render(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"bench.elastic  code {c['code']}  {c['replicas']} replicas  phases of {c['phase_seconds']:g} s  "
        f"targets TTFT <= {c['ttft_target'] * 1000:g} ms, TPOT <= {c['tpot_target'] * 1000:g} ms",
        "phases: "
        + "; ".join(
            f"{p['name']} {p['rate']:g}/s, {p['prompt_words']} -> {p['answer_tokens']} tokens" for p in c["phases"]
        ),
        "",
        f"{'layout':<8}{'phase':<14}{'sent':>6}{'ok':>6}{'good':>6}{'goodput/s':>11}"
        f"{'TTFT p50/p90/p99 ms':>24}{'TPOT p50/p90/p99 ms':>24}",
    ]
    for row in report["layouts"]:
        for phase in row["phases"]:
            lines.append(
                f"{row['layout']:<8}{phase['phase']:<14}{phase['requests']:>6}{phase['ok']:>6}{phase['good']:>6}"
                f"{phase['goodput']:>11.2f}{_triple(phase['ttft_ms']):>24}{_triple(phase['tpot_ms']):>24}"
            )
    for row in report["layouts"]:
        if row["layout"] != "both":
            continue
        lines.append("\nboth layout, work per phase (decisions; legs per node prefill/decode/whole):")
        for work in row["work"]:
            decided = ", ".join(f"{k} {v:g}" for k, v in sorted(work["decisions"].items()))
            legs = "  ".join(
                f"{node.rsplit(':', 1)[1]} " + "/".join(str(int(counts.get(kind, 0))) for kind in LEG_KINDS)
                for node, counts in sorted(work["legs_by_node"].items())
            )
            lines.append(f"  {work['phase']:<14}{decided}\n  {'':<14}{legs}")
    v = report["verdicts"]
    if v:
        lines.append(f"\nboth / best fixed, by phase: {v['both_vs_best_fixed_by_phase']} (target >= 1.0 each)")
        lines.append(
            f"both / worse fixed over the run: {v['both_vs_worse_fixed_over_the_run']} (target >= 1.3); "
            f"good requests {v['good_requests_over_the_run']}"
        )
    lines.append(f"failed requests: {report['failed_requests']}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.elastic", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--layouts", default="pd,mixed,both", help="comma-separated, of pd, mixed, both (default all three)")
    add("--phase-seconds", type=float, default=120.0, help="seconds of each phase (120)")
    add("--load-scale", type=float, default=1.0, help="multiplies every phase's arrival rate (1)")
    add("--replicas", type=int, default=2, help="proxy replicas, requests alternating over them (2)")
    add("--ttft-target", type=float, default=4.0, help="seconds to the first token a good request stays within (4)")
    add("--tpot-target", type=float, default=0.08, help="mean seconds between tokens a good request stays in (0.08)")
    add("--ttft", type=float, default=0.02, help="the nodes' fixed seconds to a first token (0.02)")
    add("--itl", type=float, default=0.04, help="the nodes' seconds between tokens alone (0.04)")
    add("--prefill-per-token", type=float, default=0.0004, help="the nodes' seconds per prompt token (0.0004)")
    add("--prefill-chunk", type=int, default=256, help="the nodes' prompt tokens per step beside decodes (256)")
    add("--batch-slowdown", type=float, default=0.01, help="each other running sequence slows a step by this (0.01)")
    add("--max-num-seqs", type=int, default=24, help="the nodes' sequences at once (24)")
    add("--scrape-load", type=float, default=0.25, help="the replicas' --scrape-load (0.25)")
    add("--request-timeout", type=float, default=120.0, help="seconds a request may take before it failed (120)")
    add("--seed", type=int, default=0)
    add("--quick", action="store_true", help="a smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    add("--json", action="store_true", help="print the report as JSON")
    add("--save", type=Path, help="also write the JSON report to this file")
    add("--logs", type=Path, help="keep the servers' logs in this directory")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.layouts = [name for name in args.layouts.split(",") if name]
    if not args.layouts or set(args.layouts) - set(LAYOUTS):
        p.error(f"--layouts must name some of {', '.join(LAYOUTS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    sys.exit(main())
