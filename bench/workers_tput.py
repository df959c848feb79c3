"""Does ``--workers 2`` double a replica's JSON throughput? Replicas of 1 and 2 workers, alternated, at c=64.

    python -m bench.workers_tput [--rounds 4] [--seconds 5] [--concurrency 64]

Two fake vLLM backends of ``../shared/bench/fake_vllm.py``, its load generator, and two replicas with static
``--mixed`` pools: one with ``--workers 1``, one with ``--workers 2``, both up for the whole run and loaded in
turn (reversed every other round), non-streamed ``/v1/completions`` as the peer harness's c=64 segment.
Nothing is pinned: on a 2-core machine the replica shares both cores with the backends and the load generator,
so a doubling cannot show in req/s alone. Each round prints, per replica: req/s, the replica's CPU (all of its
processes, in cores), req/s per replica core, each worker's share of that CPU (the kernel spreads connections
over SO_REUSEPORT listeners by hash), and the machine's busy fraction; and the direct path's req/s against the
same backends, for scale. Two workers double the throughput when their req/s per core holds at 1 worker's and
they get twice the cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.procs import PEER_BENCH, Fleet, Server, cpu_seconds, loadgen, machine_cpu_seconds

MODEL = "fake-model"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.workers_tput", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="rounds, each replica (and direct) once each (4)")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds of load per segment (5)")
    p.add_argument("--concurrency", type=int, default=64, help="connections of the load generator (64)")
    p.add_argument("--shared-bench", type=Path, default=PEER_BENCH, help="the peer harness's directory")
    return p.parse_args(argv)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return found


def _tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds so far of ``pid`` and each of its descendants, by pid."""
    todo, seen = [pid], {}
    while todo:
        current = todo.pop()
        seen[current] = cpu_seconds(current)
        todo += _children(current)
    return seen


def _load(args: argparse.Namespace, url: str, seconds: float) -> dict[str, Any]:
    return loadgen(args.shared_bench, url, args.concurrency, seconds, check=False)  # errors are counted


def _segment(args: argparse.Namespace, url: str, server: Server | None) -> dict[str, float | list[float]]:
    """One measured segment against ``url``: req/s, and the replica's CPU when ``server`` is one."""
    before = _tree_cpu(server.pid) if server else {}
    busy0, total0 = machine_cpu_seconds()
    began = time.monotonic()
    result = _load(args, url, args.seconds)
    wall = time.monotonic() - began
    busy1, total1 = machine_cpu_seconds()
    after = _tree_cpu(server.pid) if server else {}
    spent = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    cores = sum(spent.values()) / args.seconds
    figures: dict[str, float | list[float]] = {
        "rps": result["ok"] / args.seconds,
        "errors": float(result["errors"]),
        "machine_busy": (busy1 - busy0) / max(1e-9, total1 - total0),
        "wall": wall,
    }
    if server is not None:
        # the parent only supervises; a helper child (multiprocessing's resource tracker) spends nothing
        workers = sorted((v for pid, v in spent.items() if pid != server.pid and v > 0.01 * wall), reverse=True)
        figures |= {"cores": cores, "rps_per_core": result["ok"] / args.seconds / max(1e-9, cores)}
        figures["worker_cores"] = [w / args.seconds for w in workers] or [cores]
    return figures


def _proxy(fleet: Fleet, name: str, workers: int, backends: Sequence[Server]) -> Server:
    a, b = (f"127.0.0.1:{s.port}" for s in backends)
    flags = ["--mixed", a, b, "--model", MODEL, "--log-level", "warning", "--workers", str(workers)]
    return fleet.start(name, "vllm_etcd_proxy.proxy", flags, "/ready")


def _print_round(round_: int, results: dict[str, dict[str, float | list[float]]]) -> None:
    print(f"round {round_ + 1}")
    for name, r in results.items():
        line = f"  {name:9} {r['rps']:8.0f} req/s  machine busy {r['machine_busy']:.2f}"
        if "cores" in r:
            shares = " + ".join(f"{w:.2f}" for w in r["worker_cores"])  # type: ignore[union-attr]
            line += f"  replica {r['cores']:.2f} cores ({shares})  {r['rps_per_core']:7.0f} req/s per core"
        print(line, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    fake = str(args.shared_bench / "fake_vllm.py")
    rows: dict[str, list[dict[str, float | list[float]]]] = {"direct": [], "workers=1": [], "workers=2": []}
    with Fleet() as fleet:

        def node(port: int) -> list[str]:
            return [sys.executable, fake, "--port", str(port), "--model", MODEL]

        backends = [fleet.start(f"node{i}", "", [], "/health", command=node) for i in range(2)]
        proxies = {f"workers={n}": _proxy(fleet, f"workers{n}", n, backends) for n in (1, 2)}
        fleet.wait_ready(60.0)
        targets: list[tuple[str, str, Server | None]] = [("direct", backends[0].url, None)]
        targets += [(name, server.url, server) for name, server in proxies.items()]
        for _, url, _ in targets:
            _load(args, url, 1.0)  # warm: connections open, code paths taken once
        for round_ in range(args.rounds):
            results = {}
            for name, url, server in targets if round_ % 2 == 0 else reversed(targets):
                results[name] = _segment(args, url, server)
                rows[name].append(results[name])
            _print_round(round_, results)
    print(f"bench.workers_tput  c={args.concurrency}  {args.rounds} rounds of {args.seconds:g} s  medians")
    for name, values in rows.items():
        rps = statistics.median(float(v["rps"]) for v in values)  # type: ignore[arg-type]
        line = f"  {name:9} {rps:8.0f} req/s"
        if name != "direct":
            cores = statistics.median(float(v["cores"]) for v in values)  # type: ignore[arg-type]
            per_core = statistics.median(float(v["rps_per_core"]) for v in values)  # type: ignore[arg-type]
            line += f"  replica {cores:.2f} cores  {per_core:7.0f} req/s per core"
        print(line)
    w1 = statistics.median(float(v["rps"]) for v in rows["workers=1"])  # type: ignore[arg-type]
    w2 = statistics.median(float(v["rps"]) for v in rows["workers=2"])  # type: ignore[arg-type]
    print(f"  workers=2 / workers=1: {w2 / w1:.2f}x req/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
