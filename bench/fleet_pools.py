"""Proxy CPU per request as the fleet grows: the same load spread over 1 node or over N nodes.

Shows that choosing a connection costs the same however many nodes and connections there are (the transport
keeps each node's idle connections on a stack; httpcore, used before, scanned all of them on every request).
Run: ``python -m bench.fleet_pools [--nodes 8]``.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

from bench.procs import HOST, cpu_seconds, free_port

BODY = {"model": "sim-model", "prompt": "hello", "max_tokens": 16}


def _wait(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer")


async def _load(url: str, concurrency: int, total: int) -> int:
    left, ok = total, 0

    async def worker() -> None:
        nonlocal left, ok
        async with httpx.AsyncClient(timeout=60) as client:
            while left > 0:
                left -= 1
                status = (await client.post(url, json=BODY)).status_code
                ok += status == 200

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def measure(nodes: int, concurrency: int, total: int) -> dict[str, float]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = [free_port() for _ in range(nodes)]
        for port in ports:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "vllm_etcd_proxy.sim",
                        "--host",
                        HOST,
                        "--port",
                        str(port),
                        "--ttft",
                        "0",
                        "--itl",
                        "0",
                        "--log-level",
                        "warning",
                    ]
                )
            )
        for port in ports:
            _wait(f"http://{HOST}:{port}/health")
        proxy_port = free_port()
        argv = [
            sys.executable,
            "-m",
            "vllm_etcd_proxy.proxy",
            "--host",
            HOST,
            "--port",
            str(proxy_port),
            "--model",
            "sim-model",
            "--log-level",
            "warning",
            *(a for p in ports for a in ("--mixed", f"{HOST}:{p}")),
        ]
        proxy = subprocess.Popen(argv)
        procs.append(proxy)
        _wait(f"http://{HOST}:{proxy_port}/ready")
        url = f"http://{HOST}:{proxy_port}/v1/completions"
        asyncio.run(_load(url, concurrency, concurrency * 2))  # warm-up: open the connections
        cpu0, t0 = cpu_seconds(proxy.pid), time.monotonic()
        ok = asyncio.run(_load(url, concurrency, total))
        wall, cpu = time.monotonic() - t0, cpu_seconds(proxy.pid) - cpu0
        return {"nodes": nodes, "ok": ok, "req_per_s": total / wall, "proxy_cpu_ms_per_req": cpu / total * 1000}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.fleet_pools", description=__doc__)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args(argv)
    print(f"{args.requests} non-streamed requests at concurrency {args.concurrency}, nodes answer at once")
    for nodes in (1, args.nodes):
        r = measure(nodes, args.concurrency, args.requests)
        print(
            f"nodes={r['nodes']:<3.0f} ok={r['ok']:.0f}/{args.requests} req/s={r['req_per_s']:.0f} "
            f"proxy CPU per request={r['proxy_cpu_ms_per_req']:.2f} ms"
        )


if __name__ == "__main__":
    main()
