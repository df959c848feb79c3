"""Routing quality: how well each router keeps every node's prefix cache warm, spreads the load and keeps a
conversation on one node, with and without a session header, with one or several replicas.

    python -m bench.routing [--scenarios chat-short,chat-long,completions,slow-node,pd] [--quick] [--json]

For every scenario (bench/routing_plan.py) and every router in it: starts fresh vllm-sim nodes with the
simulator's prefix cache (so each router meets cold caches and counters at zero), the router's replicas if any,
runs the same multi-turn streamed sessions (bench/sessions.py; think time varies per turn, seeded, so that
sessions do not run in lockstep), then reads what each node recorded and stops everything. Requests alternate
over a router's replicas by turn, so consecutive turns of a session always go through different replicas.
Prints one table per scenario (or JSON with --json); exits 1 if any request failed. Every process started here
is stopped at the end, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.chat_sessions import placement
from bench.procs import add_run_flags, code_version, machine, parse_quick, report_and_exit_status
from bench.routing_fleet import DEFAULT_VLLM_ROUTER, Frontend, LoadSample, NodeSpec, NodeTimings, Stack, sample_load
from bench.routing_plan import SESSION_HEADER, Router, Scenario, cache_blocks, routers_in, scenarios
from bench.routing_report import Outcome, judge, render, summarise
from bench.sessions import (
    Route,
    Run,
    Target,
    Workload,
    pinned,
    round_robin,
    run_loop,
    run_sessions,
    with_request_ids,
    with_session_header,
)

QUICK = {"sessions": 16, "turns": 3, "concurrency": 8}
SCENARIOS = "chat-short,chat-long,completions,slow-node,pd"
QUICK_SCENARIOS = "chat-short,completions,slow-node,pd"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--scenarios", help=f"comma-separated, in this order (default {SCENARIOS}; with --quick {QUICK_SCENARIOS})")
    add(
        "--router",
        action="append",
        default=[],
        metavar="NAME",
        help="only the rows whose name (as printed, with R=) starts with this; repeatable",
    )
    add("--sessions", type=int, default=64, help="sessions per run (default 64)")
    add("--turns", type=int, default=6, help="turns per session (default 6)")
    add("--concurrency", type=int, default=16, help="sessions running at once (default 16)")
    add("--nodes", type=int, default=4, help="nodes per run (default 4; the P/D scenario splits them)")
    add("--replicas", type=_ints, default=(1, 2, 4), help="this project's replica counts (default 1,2,4)")
    add("--router-replicas", type=_ints, default=(1, 2), help="vllm-router's replica counts (default 1,2)")
    add("--ttft", type=float, default=0.01, help="the nodes' seconds to the first token, all cached (0.01)")
    add("--prefill-per-token", type=float, default=0.0002, help="seconds per uncached prompt token (0.0002)")
    add("--itl", type=float, default=0.005, help="seconds between tokens (0.005)")
    add(
        "--batch-slowdown",
        type=float,
        default=0.0,
        help="each other running sequence on a node makes its steps "
        "this fraction longer (0: a node is as fast under load as idle)",
    )
    add("--max-tokens", type=int, default=32, help="tokens per answer (32)")
    add("--think", type=float, default=0.0, help="least seconds between an answer and the next turn (0)")
    add("--think-jitter", type=float, default=0.05, help="plus up to this many seconds, seeded per turn (0.05)")
    add("--short-words", type=int, default=50, help="words of the short shared preamble (50)")
    add("--long-words", type=int, default=2000, help="words of the long shared preamble (2000)")
    add("--first-words", type=int, default=50, help="words of a session's first message (50)")
    add("--pd-first-words", type=int, default=300, help="the same in the P/D scenario (300)")
    add("--followup-words", type=int, default=15, help="words of each later user message (15)")
    add("--block-size", type=int, default=16, help="tokens per KV block (16)")
    add(
        "--cache-blocks",
        type=int,
        default=0,
        help="prefix cache per node, in blocks (default 0: per scenario, "
        "the shared preamble plus twice a node's fair share of the running sessions; see routing_plan.py)",
    )
    add("--slow-factor", type=float, default=3.0, help="how much slower the slow node is (3)")
    add("--vllm-router", type=Path, default=DEFAULT_VLLM_ROUTER, help=f"the binary (default {DEFAULT_VLLM_ROUTER})")
    add(
        "--scrape-load",
        type=float,
        default=0.25,
        help="the replicas' --scrape-load (0.25; vllm-proxy's own default is 0.5)",
    )
    add("--seed", type=int, default=0)
    add("--no-pin", action="store_true", help="leave CPU placement to the scheduler")
    add_run_flags(p, QUICK, "a smoke run: a few routers")
    args = parse_quick(p, argv, QUICK)
    if args.scenarios is None:
        args.scenarios = QUICK_SCENARIOS if args.quick else SCENARIOS
    if min(args.sessions, args.turns, args.concurrency, args.max_tokens, *args.replicas, *args.router_replicas) < 1:
        p.error("--sessions, --turns, --concurrency, --max-tokens and replica counts must be >= 1")
    if min(args.scrape_load, args.batch_slowdown) < 0:
        p.error("--scrape-load and --batch-slowdown must be >= 0")
    if args.nodes < 2 or args.nodes % 2:
        p.error("--nodes must be even and >= 2 (the P/D scenario splits them)")
    return args


def plan(args: argparse.Namespace) -> list[Scenario]:
    every = scenarios(
        proxy_replicas=args.replicas,
        router_replicas=args.router_replicas,
        short_words=args.short_words,
        long_words=args.long_words,
        pd_first_words=args.pd_first_words,
        slow_factor=args.slow_factor,
        quick=args.quick,
    )
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in every]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {', '.join(every)}")
    chosen = [every[n] for n in names]
    for s in list(chosen):
        if s.baseline and s.baseline not in names:  # run the healthy baseline too, for the same routers only
            chosen.insert(chosen.index(s), Scenario(**{**vars(every[s.baseline]), "routers": s.routers}))
    if args.router:
        try:
            wanted = {r.name for r in routers_in(args.router, tuple({r for s in chosen for r in s.routers}))}
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        chosen = [Scenario(**{**vars(s), "routers": tuple(r for r in s.routers if r.name in wanted)}) for s in chosen]
    if not args.vllm_router.exists():
        print(f"vllm-router not found at {args.vllm_router}: its rows are skipped", file=sys.stderr)
        chosen = [
            Scenario(**{**vars(s), "routers": tuple(r for r in s.routers if r.kind != "vllm-router")}) for s in chosen
        ]
    return [s for s in chosen if s.routers]


def workload(args: argparse.Namespace, scenario: Scenario) -> Workload:
    # One turn's duration spreads the first sessions' starts (see Workload.ramp).
    ramp = args.ttft + args.max_tokens * args.itl
    return Workload(
        sessions=args.sessions,
        concurrency=args.concurrency,
        turns=args.turns,
        max_tokens=args.max_tokens,
        system_words=scenario.system_words,
        first_words=scenario.first_words,
        followup_words=args.followup_words,
        think=args.think,
        think_jitter=args.think_jitter,
        ramp=ramp,
        api=scenario.api,
        timeout=30.0,
        seed=args.seed,
    )


def node_specs(args: argparse.Namespace, scenario: Scenario) -> list[NodeSpec]:
    healthy = NodeTimings(
        ttft=args.ttft, itl=args.itl, prefill_per_token=args.prefill_per_token, batch_slowdown=args.batch_slowdown
    )
    roles = ["prefill", "decode"] if scenario.pd else ["mixed"]
    per_role = args.nodes // len(roles)
    specs = [NodeSpec(name=f"{role}{i}", role=role, timings=healthy) for role in roles for i in range(per_role)]
    if scenario.slow_factor != 1.0:
        last = specs[-1]
        specs[-1] = NodeSpec(name=last.name, role=last.role, timings=healthy.scaled(scenario.slow_factor))
    return specs


def scenario_cache_blocks(args: argparse.Namespace, scenario: Scenario) -> int:
    if args.cache_blocks:
        return int(args.cache_blocks)
    return cache_blocks(
        system_words=scenario.system_words,
        first_words=scenario.first_words,
        followup_words=args.followup_words,
        max_tokens=args.max_tokens,
        turns=args.turns,
        concurrency=args.concurrency,
        nodes=args.nodes // (2 if scenario.pd else 1),
        block_size=args.block_size,
    )


def by_turn(urls: Sequence[str]) -> Target:
    """Replica (session + turn) % n: every turn of a session through another replica than the turn before."""
    routes = [Route(url=u) for u in urls]
    return lambda session, turn: routes[(session + turn) % len(routes)]


def target_for(router: Router, stack: Stack) -> Target:
    if router.kind == "oracle":
        return pinned(stack.urls)
    if router.kind == "direct":
        return round_robin(stack.urls)
    target = by_turn(stack.urls)
    return with_session_header(target, SESSION_HEADER) if router.header else target


async def sampled(workload: Workload, target: Target, nodes: Sequence[tuple[str, str]]) -> tuple[Run, list[LoadSample]]:
    """The sessions, with the nodes' load sampled meanwhile."""
    samples: list[LoadSample] = []
    sampler = asyncio.create_task(sample_load(nodes, samples))
    try:
        return await run_sessions(workload, target), samples
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler


def measure(
    args: argparse.Namespace, scenario: Scenario, router: Router, tag: str, where: dict[str, Any], pids: dict[str, int]
) -> Outcome:
    specs = node_specs(args, scenario)
    blocks = scenario_cache_blocks(args, scenario)
    frontend = Frontend(
        kind=router.kind if router.kind in ("proxy", "vllm-router") else "direct",
        policy=router.policy,
        replicas=router.replicas,
        extra=router.extra,
    )
    logs = args.logs / tag if args.logs else None
    proxy_cpus = set(where["proxy_cpus"]) if where["pinned"] else None
    with Stack(
        specs,
        frontend,
        cache_blocks=blocks,
        block_size=args.block_size,
        output_len=args.max_tokens,
        proxy_cpus=proxy_cpus,
        vllm_router=args.vllm_router,
        logs=logs,
        scrape_load=args.scrape_load,
    ) as stack:
        pids.update({f"{tag}/{name}": pid for name, pid in stack.pids.items()})
        cpu0 = stack.cpu()
        target = with_request_ids(target_for(router, stack), tag)
        run, samples = run_loop(sampled(workload(args, scenario), target, stack.named_nodes))
        cpu1 = stack.cpu()
        nodes = stack.node_reports()
    slow = specs[-1].name if scenario.slow_factor != 1.0 else None
    return Outcome(
        scenario=scenario.name,
        router=router.label,
        kind=router.kind,
        replicas=router.replicas,
        tag=tag,
        run=run,
        nodes=nodes,
        cpu={k: cpu1[k] - cpu0[k] for k in cpu0},
        load=samples,
        slow_node=slow,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    loadavg_start = Path("/proc/loadavg").read_text().split()[0]
    started_at = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    started = time.monotonic()
    where = placement(not args.no_pin)
    pids: dict[str, int] = {}
    results: list[dict[str, Any]] = []
    for scenario in plan(args):
        rows: list[dict[str, Any]] = []
        blocks = scenario_cache_blocks(args, scenario)
        for router in scenario.routers:
            tag = f"r{sum(len(s['rows']) for s in results) + len(rows)}"
            outcome = measure(args, scenario, router, tag, where, pids)
            row = summarise(outcome)
            rows.append(row)
            print(
                f"[{scenario.name}] {router.name}: {row['ok']}/{row['requests']} ok, hit rate "
                f"{row['hit_rate'] or 0:.3f}, TTFT p50 {row['ttft_ms']['p50'] or 0:.1f} ms, "
                f"{row['wall_s']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        healthy: list[dict[str, Any]] = next((s["rows"] for s in results if s["name"] == scenario.baseline), [])
        results.append(
            {
                "name": scenario.name,
                "description": f"{scenario.description}; prefix cache {blocks} blocks per node",
                "cache_blocks": blocks,
                "rows": rows,
                "targets": judge(rows, healthy),
            }
        )
    failed = sum(r["failed"] for s in results for r in s["rows"])
    return {
        "machine": machine(started_at, loadavg_start),
        "code": code_version(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("json",)},
        "placement": where,
        "scenarios": results,
        "server_pids": pids,
        "wall_s": time.monotonic() - started,
        "ok": failed == 0 and all(r["ok"] > 0 for s in results for r in s["rows"]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    sys.exit(main())
