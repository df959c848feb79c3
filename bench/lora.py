"""LoRA adapters over a fleet (issue 19): loaded on demand and routed where active, against preloaded and round-robin.

Each run starts etcd, ``--nodes`` vllm-sim nodes (``--enable-lora --max-loras 4``; an adapter swapped into a
slot costs ``--swap-time`` of its request's first token, a runtime load ``--load-time``) and one vllm-proxy
watching etcd, registers ``--adapters`` adapters in etcd, then sends ``--requests`` streamed completions,
``--concurrency`` at a time, the first adapter taking ``--hot`` of them and the others the rest alike:

- ``on-demand``: no node has an adapter at start; the proxy loads each where its requests need it.
- ``preloaded``: every node has every adapter from the start (``--lora-modules``), same proxy.
- ``round-robin``: preloaded, ``--policy round-robin`` and no load scrape: each adapter's requests go to its
  nodes in turn, blind to where it is active.

Reported: failed requests, TTFT p50/p99, adapter swaps on the nodes per 1,000 requests, loads.
Run: ``python -m bench.lora [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import httpx

from bench.procs import Fleet, add_run_flags, code_version, parse_quick, report_and_exit_status
from bench.report import percentiles_ms
from bench.scale_etcd import etcd_command
from vllm_etcd_proxy.fleet.adapters import adapter_key, adapter_value
from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdSettings
from vllm_etcd_proxy.fleet.records import KeyLayout, Role

MODEL = "sim-model"
RUNS = ("on-demand", "preloaded", "round-robin")
QUICK = {"requests": 200, "concurrency": 8}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n", 1)[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--hot", type=float, default=0.5, help="share of the requests for the first adapter (0.5)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--swap-time", type=float, default=0.05, help="seconds a swap adds to TTFT (0.05)")
    p.add_argument("--load-time", type=float, default=0.2, help="seconds a runtime load takes (0.2)")
    p.add_argument("--runs", default=",".join(RUNS), help="which runs, comma-separated")
    p.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the proxy of the on-demand and preloaded runs (repeatable)",
    )
    add_run_flags(p, QUICK, "a short run")
    return parse_quick(p, argv, QUICK)


def pick(rng: random.Random, args: argparse.Namespace) -> str:
    if rng.random() < args.hot:
        return "lora0"
    return f"lora{rng.randrange(1, args.adapters)}"


async def _one(client: httpx.AsyncClient, url: str, model: str, i: int, tokens: int) -> float | None:
    """TTFT in seconds of one streamed completion, None when it failed."""
    body = {
        "model": model,
        "prompt": f"request {i} for {model}",
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
    }
    started = time.monotonic()
    first: float | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return None
            async for line in response.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.monotonic() - started
                if line == "data: [DONE]":
                    return first
    except httpx.HTTPError:
        return None
    return None


async def _load(url: str, args: argparse.Namespace) -> tuple[list[float], int]:
    rng = random.Random(19)
    plan = [pick(rng, args) for _ in range(args.requests)]
    ttfts: list[float] = []
    failed = 0
    queue = iter(enumerate(plan))

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal failed
        for i, model in queue:
            ttft = await _one(client, url, model, i, args.max_tokens)
            if ttft is None:
                failed += 1
            else:
                ttfts.append(ttft)

    async with httpx.AsyncClient(timeout=120.0, limits=httpx.Limits(max_connections=args.concurrency)) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    return ttfts, failed


async def _register(endpoint: str, args: argparse.Namespace, ports: list[int]) -> None:
    """The adapters, then the nodes as bare keys (their models learned from their /v1/models)."""
    layout = KeyLayout()
    async with EtcdClient(EtcdSettings(endpoints=(endpoint,))) as etcd:
        for i in range(args.adapters):
            await etcd.put(adapter_key(layout, f"lora{i}"), adapter_value(f"/loras/lora{i}", MODEL))
        for port in ports:
            await etcd.put(layout.key(Role.MIXED, f"127.0.0.1:{port}"), b"")


def _wait_listed(url: str, args: argparse.Namespace, timeout: float = 30.0) -> None:
    wanted = {f"lora{i}" for i in range(args.adapters)}
    deadline = time.monotonic() + timeout
    while not wanted <= {c["id"] for c in httpx.get(f"{url}/v1/models", timeout=5.0).json()["data"]}:
        if time.monotonic() > deadline:
            raise TimeoutError("the proxy did not list every adapter")
        time.sleep(0.05)


def run_one(name: str, args: argparse.Namespace, logs: Any) -> dict[str, Any]:
    preload = name != "on-demand"
    node_flags = [
        "--model",
        MODEL,
        "--enable-lora",
        "--max-loras",
        str(args.max_loras),
        "--lora-swap-time",
        str(args.swap_time),
        "--lora-load-time",
        str(args.load_time),
        "--ttft",
        "0.02",
        "--itl",
        "0.01",
        "--log-level",
        "warning",
    ]
    if preload:
        node_flags += ["--lora-modules", *(f"lora{i}=/loras/lora{i}" for i in range(args.adapters))]
    proxy_flags = ["--scrape-load", "0" if name == "round-robin" else "0.1", "--log-level", "warning"]
    if name == "round-robin":
        proxy_flags += ["--policy", "round-robin"]
    else:
        proxy_flags += args.proxy_arg
    with Fleet(logs / name if logs else None) as fleet:
        peer = fleet.port()
        etcd = fleet.start(
            "etcd", "", [], "/health", command=lambda port: etcd_command(fleet.log_dir / "etcd-data", port, peer)
        )
        nodes = [fleet.start(f"node{i}", "vllm_etcd_proxy.sim", node_flags, "/health") for i in range(args.nodes)]
        fleet.wait_ready()
        asyncio.run(_register(etcd.url, args, [n.port for n in nodes]))
        proxy = fleet.start("proxy", "vllm_etcd_proxy.proxy", ["--etcd", etcd.url, *proxy_flags], "/ready")
        fleet.wait_ready()
        _wait_listed(proxy.url, args)
        started = time.monotonic()
        ttfts, failed = asyncio.run(_load(proxy.url, args))
        elapsed = time.monotonic() - started
        counters = [httpx.get(f"{n.url}/sim/requests", timeout=10.0).json()["counters"] for n in nodes]
    swaps, loads = sum(c.get("lora_swaps", 0) for c in counters), sum(c.get("lora_loads", 0) for c in counters)
    return {
        "run": name,
        "requests": args.requests,
        "failed": failed,
        "seconds": round(elapsed, 2),
        "ttft_ms": percentiles_ms(ttfts),
        "swaps": swaps,
        "swaps_per_1000": round(1000 * swaps / args.requests, 1),
        "loads": loads,
        "per_node": [c.get("completed", 0) for c in counters],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"  # the nodes' runtime load routes (as in vLLM)
    runs = [run_one(name, args, args.logs) for name in args.runs.split(",")]
    config = {
        k: getattr(args, k)
        for k in (
            "nodes",
            "adapters",
            "max_loras",
            "hot",
            "requests",
            "concurrency",
            "max_tokens",
            "swap_time",
            "load_time",
        )
    }
    return {"ok": all(r["failed"] == 0 for r in runs), "code": code_version(), "config": config, "runs": runs}


def render(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"{c['adapters']} adapters ({c['hot']:.0%} of requests for one), {c['nodes']} nodes with --max-loras "
        f"{c['max_loras']}, {c['requests']} streamed requests, {c['concurrency']} at a time; code {report['code']}",
        f"{'run':<12} {'failed':>6} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'swaps/1000':>11} {'loads':>6}",
    ]
    for r in report["runs"]:
        t = r["ttft_ms"]
        lines.append(
            f"{r['run']:<12} {r['failed']:>6} {t.get('p50') or 0:>12.1f} {t.get('p99') or 0:>12.1f} "
            f"{r['swaps_per_1000']:>11.1f} {r['loads']:>6}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    raise SystemExit(main())
