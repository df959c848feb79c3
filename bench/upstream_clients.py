"""Which HTTP client should carry the proxy's requests to the nodes: CPU per request and per streamed token.

    python -m bench.upstream_clients [--requests 3000] [--streams 200] [--tokens 128] [--concurrency 8]

The candidates for the data path, each in a fresh process of its own on uvloop, send the same requests to the
same ``vllm-sim`` node (ttft 0, itl 0) and read every answer to its end, as the relay does:

- ``transport``: ours (proxy/transport.py: asyncio protocols + httptools, idle connections on a stack);
- ``httpcore``: httpcore's AsyncConnectionPool used directly (what httpx runs on, without httpx's layers);
- ``aiohttp``: aiohttp's ClientSession, reading bodies with ``iter_any``;
- ``httpx``: httpx.AsyncClient, what the data path used before.

Figures are the client process's own CPU (``time.process_time``) per non-streamed request and per streamed
token (SSE event), median over ``--rounds``; the node runs on another CPU when there are two. Only the client's
cost is measured: the node's speed sets the wall time, not these figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import uvloop

from bench.procs import Fleet

MODEL = "sim-model"
CANDIDATES = ("transport", "httpcore", "aiohttp", "httpx")
Fetch = Callable[[bytes], Awaitable[int]]
"""Sends one request body, reads the whole answer, returns the number of body bytes."""


async def _transport_client(url: str, concurrency: int) -> tuple[Fetch, Callable[[], Awaitable[None]]]:
    from vllm_etcd_proxy.proxy.upstream.transport import HttpTransport, Origin, UpstreamRequest

    transport = HttpTransport(connect_timeout=5, max_connections=concurrency * 2)
    origin = Origin.of(url)
    head = b"content-type: application/json\r\n"

    async def fetch(body: bytes) -> int:
        response = await transport.send(
            UpstreamRequest(origin=origin, path=b"/v1/completions", head=head, body=body, timeout=30, idle_timeout=30)
        )
        size = 0
        while chunk := await response.read():
            size += len(chunk)
        response.close()
        return size

    async def close() -> None:
        transport.close()

    return fetch, close


async def _httpcore_client(url: str, concurrency: int) -> tuple[Fetch, Callable[[], Awaitable[None]]]:
    import httpcore

    pool = httpcore.AsyncConnectionPool(max_connections=concurrency * 2)
    target = f"{url}/v1/completions"

    async def fetch(body: bytes) -> int:
        size = 0
        async with pool.stream("POST", target, headers=[(b"content-type", b"application/json")], content=body) as r:
            async for chunk in r.aiter_stream():
                size += len(chunk)
        return size

    return fetch, pool.aclose


async def _aiohttp_client(url: str, concurrency: int) -> tuple[Fetch, Callable[[], Awaitable[None]]]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())
    target = f"{url}/v1/completions"

    async def fetch(body: bytes) -> int:
        size = 0
        async with session.post(target, data=body, headers={"content-type": "application/json"}) as r:
            async for chunk in r.content.iter_any():
                size += len(chunk)
        return size

    return fetch, session.close


async def _httpx_client(url: str, concurrency: int) -> tuple[Fetch, Callable[[], Awaitable[None]]]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    client = httpx.AsyncClient(limits=limits, timeout=30)
    target = f"{url}/v1/completions"

    async def fetch(body: bytes) -> int:
        size = 0
        async with client.stream("POST", target, content=body, headers={"content-type": "application/json"}) as r:
            async for chunk in r.aiter_raw():
                size += len(chunk)
        return size

    return fetch, client.aclose


CLIENTS = {
    "transport": _transport_client,
    "httpcore": _httpcore_client,
    "aiohttp": _aiohttp_client,
    "httpx": _httpx_client,
}


async def _phase(fetch: Fetch, body: bytes, requests: int, concurrency: int) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, bytes) for ``requests`` requests with ``concurrency`` in flight."""
    left = requests
    received = 0

    async def worker() -> None:
        nonlocal left, received
        while left > 0:
            left -= 1
            received += await fetch(body)

    cpu, wall = time.process_time(), time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.process_time() - cpu, time.monotonic() - wall, received


async def _measure(name: str, url: str, args: dict[str, Any]) -> dict[str, Any]:
    fetch, close = await CLIENTS[name](url, args["concurrency"])
    plain = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 16}).encode()
    stream = json.dumps(
        {"model": MODEL, "prompt": "hello there", "max_tokens": args["tokens"], "stream": True, "ignore_eos": True}
    ).encode()
    await _phase(fetch, plain, 4 * args["concurrency"], args["concurrency"])  # warm-up: open the connections
    cpu, wall, _ = await _phase(fetch, plain, args["requests"], args["concurrency"])
    s_cpu, s_wall, _ = await _phase(fetch, stream, args["streams"], args["concurrency"])
    await close()
    per_request = cpu / args["requests"]
    return {
        "client": name,
        "cpu_us_per_request": 1e6 * per_request,
        "cpu_us_per_token": 1e6 * (s_cpu - per_request * args["streams"]) / (args["streams"] * args["tokens"]),
        "requests_per_s": args["requests"] / wall,
        "streams_per_s": args["streams"] / s_wall,
    }


def _child(name: str, url: str, args: dict[str, Any], cpu: int | None, out: Any) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    out.send(uvloop.run(_measure(name, url, args)))


def run_candidate(name: str, url: str, args: dict[str, Any], cpu: int | None) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(name, url, args, cpu, send))
    process.start()
    result: dict[str, Any] = receive.recv()
    process.join()
    return result


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.upstream_clients", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="non-streamed requests per candidate and round")
    p.add_argument("--streams", type=int, default=200, help="streamed requests per candidate and round")
    p.add_argument("--tokens", type=int, default=128, help="tokens (SSE events) per stream")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="rounds over all candidates; figures are medians")
    p.add_argument("--only", default=",".join(CANDIDATES), help="comma-separated candidates")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    args = {"requests": a.requests, "streams": a.streams, "tokens": a.tokens, "concurrency": a.concurrency}
    names = [n for n in a.only.split(",") if n]
    two = len(os.sched_getaffinity(0)) >= 2
    with Fleet() as fleet:
        node = fleet.start(
            "node",
            "vllm_etcd_proxy.sim",
            ["--ttft", "0", "--itl", "0", "--max-num-seqs", "1024", "--log-level", "warning"],
            "/health",
        )
        fleet.wait_ready()
        if two:
            os.sched_setaffinity(node.pid, {0})
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for _ in range(a.rounds):
            for name in names:
                runs[name].append(run_candidate(name, node.url, args, 1 if two else None))
    rows = []
    for name in names:
        row: dict[str, Any] = {"client": name}
        for key in ("cpu_us_per_request", "cpu_us_per_token", "requests_per_s", "streams_per_s"):
            row[key] = statistics.median(r[key] for r in runs[name])
        rows.append(row)
    if a.json:
        print(json.dumps({"config": {**args, "rounds": a.rounds, "pinned": two}, "clients": rows}, indent=2))
        return
    print(
        f"{a.requests} requests and {a.streams} streams of {a.tokens} tokens per round, concurrency "
        f"{a.concurrency}, {a.rounds} rounds (medians); client {'on its own CPU' if two else 'unpinned'}"
    )
    print(f"{'client':<10} {'CPU us/request':>15} {'CPU us/token':>13} {'req/s':>8} {'streams/s':>10}")
    for row in rows:
        print(
            f"{row['client']:<10} {row['cpu_us_per_request']:>15.0f} {row['cpu_us_per_token']:>13.1f} "
            f"{row['requests_per_s']:>8.0f} {row['streams_per_s']:>10.1f}"
        )


if __name__ == "__main__":
    main()
