"""What a replica's load scrape costs: CPU per scrape of a node's /metrics (--scrape-load), against an httpx
client scraping the same nodes in this process, in the same run.

    python -m bench.scrape_cost [--nodes 8] [--interval 0.05] [--seconds 10] [--json]

Starts ``--nodes`` idle vllm-sim nodes (pinned to CPU 0) and two replicas of the proxy over them (pinned to
CPU 1): one scraping every ``--interval`` seconds, one not scraping at all. A scrape's cost is the difference of
the two replicas' CPU time over ``--seconds``, divided by the scrapes made (nodes x seconds / interval). Then
this process fetches every node's /metrics with httpx as many times, on one keep-alive client, and parses each
page as the replica does: that is what the replica's scrape cost before it used its own HTTP client.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.procs import Fleet, code_version, machine, own_cpu_seconds, report_and_exit_status
from vllm_etcd_proxy.fleet.vllm import read_node_load, read_token_latency


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scrape_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--interval", type=float, default=0.05, help="the scraping replica's --scrape-load (0.05)")
    p.add_argument("--seconds", type=float, default=10.0, help="how long CPU time is counted (10)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    p.add_argument("--save", type=Path, help="also write the JSON report to this file")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.interval <= 0 or args.seconds <= 0:
        p.error("--nodes, --interval and --seconds must be positive")
    return args


async def _httpx_scrapes(urls: list[str], rounds: int) -> float:
    """CPU seconds of this process for ``rounds`` scrapes of every url, parsed as the replica parses them."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        for url in urls:  # connections open before the count starts, as a replica's are
            (await client.get(url)).raise_for_status()
        started = own_cpu_seconds()
        for _ in range(rounds):
            for url in urls:
                response = await client.get(url)
                response.raise_for_status()
                read_node_load(response.content)
                read_token_latency(response.content)
        return own_cpu_seconds() - started


def run(args: argparse.Namespace) -> dict[str, object]:
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    loadavg = Path("/proc/loadavg").read_text().split()[0]
    with Fleet() as fleet:
        nodes = [
            fleet.start(f"node{i}", "vllm_etcd_proxy.sim", ["--log-level", "warning"], "/health")
            for i in range(args.nodes)
        ]
        fleet.wait_ready()
        mixed = [arg for node in nodes for arg in ("--mixed", f"127.0.0.1:{node.port}")]
        common = [*mixed, "--model", "sim-model", "--log-level", "warning"]
        scraping = fleet.start(
            "scraping", "vllm_etcd_proxy.proxy", [*common, "--scrape-load", str(args.interval)], "/ready"
        )
        quiet = fleet.start("quiet", "vllm_etcd_proxy.proxy", [*common, "--scrape-load", "0"], "/ready")
        fleet.wait_ready()
        for node in nodes:
            node.pin({0})
        for replica in (scraping, quiet):
            replica.pin({1})
        time.sleep(1.0)  # the first scrapes open their connections
        before = scraping.cpu(), quiet.cpu()
        time.sleep(args.seconds)
        spent = scraping.cpu() - before[0], quiet.cpu() - before[1]
        rounds = round(args.seconds / args.interval)
        scrapes = rounds * args.nodes
        urls = [f"{node.url}/metrics" for node in nodes]
        page = len(httpx.get(urls[0]).content)
        httpx_cpu = asyncio.run(_httpx_scrapes(urls, rounds))
    replica_per_scrape = (spent[0] - spent[1]) / scrapes
    return {
        "ok": True,
        "code": code_version(),
        "machine": machine(started, loadavg),
        "nodes": args.nodes,
        "interval": args.interval,
        "seconds": args.seconds,
        "scrapes": scrapes,
        "page_bytes": page,
        "replica_cpu_scraping": spent[0],
        "replica_cpu_quiet": spent[1],
        "replica_us_per_scrape": replica_per_scrape * 1e6,
        "httpx_us_per_scrape": httpx_cpu / scrapes * 1e6,
    }


def render(report: dict[str, object]) -> str:
    r = report
    return "\n".join(
        [
            f"scrape cost: {r['nodes']} idle vllm-sim nodes, /metrics page {r['page_bytes']} bytes; code {r['code']}",
            f"replica scraping every {r['interval']} s: {r['replica_cpu_scraping']:.3f} s CPU in {r['seconds']} s; "
            f"not scraping: {r['replica_cpu_quiet']:.3f} s; {r['scrapes']} scrapes",
            f"  replica:          {r['replica_us_per_scrape']:7.0f} us CPU per scrape (fetch and parse)",
            f"  httpx, in-process: {r['httpx_us_per_scrape']:6.0f} us CPU per scrape (fetch and parse)",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    sys.exit(main())
