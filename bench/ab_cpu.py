"""A/B of the replica's CPU per request: two or more builds of vllm-proxy, alternated, on the same fake backends.

    python -m bench.ab_cpu NAME=CHECKOUT [NAME=CHECKOUT ...] [--mode mixed|pd] [--rounds 4] [--seconds 4]

Each NAME=CHECKOUT is a directory holding this project's sources (``.`` for this checkout, a ``git worktree``
of another commit for the code before); each runs as ``python -m vllm_etcd_proxy.proxy`` from it, with this
virtualenv's Python. Two fake vLLM backends of ``../shared/bench/fake_vllm.py``, one replica at a time with
static pools (``--mixed`` both backends, or ``--prefill`` one and ``--decode`` the other), ``loadgen.py`` at
c=8 non-streamed (``--stream``: streamed, per chunk). Builds take turns round by round, in reverse order every
other round, so a noisy minute falls on every build alike. Per build: CPU µs per request (or chunk) of each
round, all threads from schedstat, and the median. This is the figure the peer harness's one-peer-after-another
segments cannot give when the machine is not quiet: ratios between builds of this project in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.procs import PEER_BENCH, cpu_seconds, free_port, loadgen

MODEL = "fake-model"
HOST = "127.0.0.1"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ab_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("builds", nargs="+", metavar="NAME=CHECKOUT", help="a build to measure ('.': this checkout)")
    p.add_argument("--mode", choices=("mixed", "pd"), default="mixed", help="static pools (mixed)")
    p.add_argument("--rounds", type=int, default=4, help="rounds, every build once each (4)")
    p.add_argument("--seconds", type=float, default=4.0, help="measured seconds of load per build and round (4)")
    p.add_argument("--stream", action="store_true", help="streamed requests of 64 tokens: CPU per chunk")
    p.add_argument("--shared-bench", type=Path, default=PEER_BENCH, help="the peer harness's directory")
    args = p.parse_args(argv)
    builds = {}
    for spec in args.builds:
        name, sep, checkout = spec.partition("=")
        path = Path(checkout).resolve()
        if not sep or not name or not (path / "vllm_etcd_proxy").is_dir():
            p.error(f"{spec!r}: not NAME=CHECKOUT with CHECKOUT a directory holding vllm_etcd_proxy/")
        builds[name] = path
    args.builds = builds
    return args


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}: not ready after {timeout:g} s")


def _load(args: argparse.Namespace, url: str, seconds: float) -> dict[str, Any]:
    extra = ["--stream", "--max-tokens", "64"] if args.stream else []
    return loadgen(args.shared_bench, url, 8, seconds, *extra)


def _one(args: argparse.Namespace, checkout: Path, backends: Sequence[int], log: Path) -> float:
    """One build, one round: its CPU µs per request (per chunk with ``--stream``)."""
    port = free_port()
    a, b = (f"{HOST}:{p}" for p in backends)
    pools = ["--mixed", a, b] if args.mode == "mixed" else ["--prefill", a, "--decode", b]
    command = [sys.executable, "-m", "vllm_etcd_proxy.proxy", "--host", HOST, "--port", str(port), *pools]
    command += ["--model", MODEL, "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    with log.open("ab") as out:
        proc = subprocess.Popen(command, cwd=checkout, env=env, stdout=out, stderr=out)
    url = f"http://{HOST}:{port}"
    try:
        _wait_ready(f"{url}/ready", proc)
        _load(args, url, 1.0)  # warm: connections open, code paths taken once
        before = cpu_seconds(proc.pid)
        result = _load(args, url, args.seconds)
        spent = cpu_seconds(proc.pid) - before
    finally:
        proc.terminate()
        proc.wait(10)
    count = float(result.get("chunks", result["ok"]) if args.stream else result["ok"])
    return spent * 1e6 / max(1.0, count)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    fake = args.shared_bench / "fake_vllm.py"
    ports = [free_port(), free_port()]
    logs = Path(tempfile.mkdtemp(prefix="ab-cpu-"))
    backends = [
        subprocess.Popen(
            [sys.executable, str(fake), "--port", str(port), "--model", MODEL],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    figures: dict[str, list[float]] = {name: [] for name in args.builds}
    try:
        for port, proc in zip(ports, backends, strict=True):
            _wait_ready(f"http://{HOST}:{port}/health", proc)
        order = list(args.builds.items())
        for round_ in range(args.rounds):
            for name, checkout in order if round_ % 2 == 0 else reversed(order):
                figures[name].append(_one(args, checkout, ports, logs / f"{name}.log"))
    finally:
        for proc in backends:
            proc.terminate()
            proc.wait(10)
    unit = "chunk" if args.stream else "request"
    print(f"bench.ab_cpu  {args.mode}  c=8  {args.rounds} rounds of {args.seconds:g} s  CPU us per {unit}")
    for name, values in figures.items():
        rounds = " ".join(f"{v:.1f}" for v in values)
        print(f"  {name:12} median {statistics.median(values):7.1f}   rounds {rounds}")
    print(f"logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
