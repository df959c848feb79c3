"""The load generator: a fixed number of requests at a fixed concurrency, from an asyncio loop on httpx.

``concurrency`` workers take requests from a shared count until it runs out, so a phase sends exactly
``requests`` requests. A request succeeds only with status 200 and a complete body: a JSON completion with
choices, or an SSE stream with one event per asked token and the final ``[DONE]``.

Clients: ``shared`` puts every worker on one ``httpx.AsyncClient``; ``per-worker`` gives each worker its own.
They differ in the generator's CPU cost: httpcore's pool scans all of its connections on every request
(see bench/README.md), so one client with 16 connections costs about twice the CPU per request.

A phase may be split over several processes (``Generator(processes=N)``), each with its own event loop and
clients, meeting the caller on a barrier after their warm-up so that all start measuring together.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import ssl
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from bench.procs import die_with_parent, own_cpu_seconds

PREFILL_KV_TRANSFER_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What a client running the disaggregated exchange itself sends on the prefill leg (as the proxy does)."""
CLIENT_MODES = ("per-worker", "shared")


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where a request goes: ``url`` (a /v1/completions URL), after a prefill leg to ``prefill_url`` if set."""

    url: str
    prefill_url: str | None = None
    ca_bundle: str | None = None
    """For an ``https://`` url: the CAs its certificate chains to (None: the system's)."""


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One measured batch of identical requests."""

    target: Target
    body: Mapping[str, Any]
    requests: int
    concurrency: int
    clients: str
    """per-worker or shared."""
    warmup: int
    """Requests sent first and not counted: they open the connections (servers close idle ones after 5 s)."""
    timeout: float
    """Seconds for the measured part; requests unfinished then count as failed."""
    keepalive: bool = True
    """Reuse connections; False opens a new one (a new TLS handshake over https) for every request."""


@dataclass(kw_only=True)
class Result:
    """What one phase measured, merged over processes when it was split."""

    ok: int = 0
    failed: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    started: float = float("inf")
    ended: float = 0.0
    """perf_counter() at the start and end (CLOCK_MONOTONIC: comparable between processes)."""
    latencies: list[float] = field(default_factory=list)
    """Seconds from sending to the last byte, successful requests only."""
    ttfts: list[float] = field(default_factory=list)
    """Seconds from sending to the first token event, successful streams only."""
    events: int = 0
    """SSE token events received by successful streams."""
    generator_cpu: float = 0.0

    @property
    def wall(self) -> float:
        return max(self.ended - self.started, 1e-9)

    def merge(self, other: Result) -> None:
        self.ok += other.ok
        self.failed += other.failed
        self.errors.update(other.errors)
        self.started = min(self.started, other.started)
        self.ended = max(self.ended, other.ended)
        self.latencies += other.latencies
        self.ttfts += other.ttfts
        self.events += other.events
        self.generator_cpu += other.generator_cpu


class BadAnswer(Exception):
    """A response that is not a complete, well-formed success."""


def completion_body(*, model: str, tokens: int, stream: bool) -> dict[str, Any]:
    """A request for exactly ``tokens`` tokens (``ignore_eos``, a vLLM extension, rules out an early EOS)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": "The proxy should cost little.",
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    if stream:
        body["stream"] = True
    return body


async def _stream(client: httpx.AsyncClient, url: str, body: Mapping[str, Any], t0: float) -> tuple[float, int]:
    """Reads an SSE completion; returns (seconds to the first token event, token events)."""
    first = 0.0
    events = 0
    done = False
    buffer = b""
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise BadAnswer(f"status {response.status_code}")
        async for chunk in response.aiter_raw():
            buffer += chunk
            *complete, buffer = buffer.split(b"\n\n")
            for event in complete:
                if event.startswith(b"data: [DONE]"):
                    done = True
                elif event.startswith(b'data: {"error"'):
                    raise BadAnswer("error event in the stream")
                elif event.startswith(b"data: "):
                    if not events:
                        first = time.perf_counter() - t0
                    events += 1
    if not done:
        raise BadAnswer("stream ended without [DONE]")
    return first, events


async def _prefill(client: httpx.AsyncClient, url: str, body: Mapping[str, Any]) -> Any:
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    leg.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    response = await client.post(url, json=leg)
    if response.status_code != 200:
        raise BadAnswer(f"prefill leg: status {response.status_code}")
    return response.json().get("kv_transfer_params")


async def _one(client: httpx.AsyncClient, phase: Phase, result: Result) -> None:
    body = phase.body
    t0 = time.perf_counter()
    if phase.target.prefill_url is not None:
        body = {**body, "kv_transfer_params": await _prefill(client, phase.target.prefill_url, body)}
    if body.get("stream"):
        first, events = await _stream(client, phase.target.url, body, t0)
        if events != body["max_tokens"]:
            raise BadAnswer(f"{events} token events for max_tokens={body['max_tokens']}")
        result.ttfts.append(first)
        result.events += events
    else:
        response = await client.post(phase.target.url, json=body)
        if response.status_code != 200:
            raise BadAnswer(f"status {response.status_code}")
        if not response.json().get("choices"):
            raise BadAnswer("no choices in the completion")
    result.latencies.append(time.perf_counter() - t0)
    result.ok += 1


async def _run(phase: Phase, clients: Sequence[httpx.AsyncClient]) -> Result:
    result = Result()
    left = phase.requests

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            try:
                await _one(client, phase, result)
            except Exception as exc:  # noqa: BLE001 - whatever went wrong, the request failed; count it
                result.failed += 1
                result.errors[f"{type(exc).__name__}: {exc}"[:160]] += 1

    cpu0 = own_cpu_seconds()
    result.started = time.perf_counter()
    workers = [asyncio.create_task(worker(clients[i % len(clients)])) for i in range(phase.concurrency)]
    try:
        async with asyncio.timeout(phase.timeout):
            await asyncio.gather(*workers)
    except TimeoutError:
        # Counted, not raised: the report shows how many did not finish in time.
        result.failed += left + sum(1 for w in workers if w.cancelled())
        result.errors[f"phase timeout after {phase.timeout:g} s"] += 1
    result.ended = time.perf_counter()
    result.generator_cpu = own_cpu_seconds() - cpu0
    return result


async def run_phase(phase: Phase, on_start: Callable[[], None] = lambda: None) -> Result:
    """Warm up, call ``on_start`` (blocking is fine: nothing is in flight), then measure. Never raises for a
    failed request: failures are counted in the result."""
    n = phase.concurrency
    timeout = httpx.Timeout(30.0)
    # One context for every client: loading the CAs costs milliseconds each time.
    verify = ssl.create_default_context(cafile=phase.target.ca_bundle)
    if phase.clients == "shared":
        kept = n if phase.keepalive else 0
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=kept, keepalive_expiry=300)
        clients = [httpx.AsyncClient(limits=limits, timeout=timeout, verify=verify)]
    else:
        kept = 2 if phase.keepalive else 0
        limits = httpx.Limits(max_connections=2, max_keepalive_connections=kept, keepalive_expiry=300)
        clients = [httpx.AsyncClient(limits=limits, timeout=timeout, verify=verify) for _ in range(n)]
    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(client)
        if phase.warmup:
            await _run(replace(phase, requests=phase.warmup), clients)
        on_start()
        return await _run(phase, clients)


def _event_loop_run(coro: Any) -> Any:
    try:
        import uvloop  # the proxy and the node run on uvloop too (uvicorn[standard])
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def split(phase: Phase, parts: int) -> list[Phase]:
    """``phase`` as ``parts`` phases: concurrency shared as evenly as possible, requests and warm-up in proportion
    (a part with no concurrency gets no requests; it only meets the others on the barrier)."""
    concurrency = [phase.concurrency // parts + (i < phase.concurrency % parts) for i in range(parts)]

    def proportional(total: int) -> list[int]:
        shares = [total * c // phase.concurrency for c in concurrency]
        for i in range(total - sum(shares)):  # fewer than the parts with concurrency, which come first
            shares[i] += 1
        return shares

    requests, warmup = proportional(phase.requests), proportional(phase.warmup)
    shares = zip(concurrency, requests, warmup, strict=True)
    return [replace(phase, concurrency=c, requests=r, warmup=w) for c, r, w in shares]


_barrier: Any = None


def _worker_init(barrier: Any) -> None:
    global _barrier
    _barrier = barrier
    die_with_parent()


def _worker_phase(phase: Phase, timeout: float) -> Result:
    result: Result = _event_loop_run(run_phase(phase, on_start=lambda: _barrier.wait(timeout)))
    return result


class Generator:
    """Runs phases in this process (``processes=1``) or split over worker processes."""

    def __init__(self, processes: int = 1) -> None:
        self.processes = processes
        self._pool: Any = None
        self._barrier: Any = None
        if processes > 1:
            context = multiprocessing.get_context("spawn")
            self._barrier = context.Barrier(processes + 1)
            self._pool = context.Pool(processes, initializer=_worker_init, initargs=(self._barrier,))

    def run(self, phase: Phase, on_start: Callable[[], None]) -> Result:
        """One phase; ``on_start`` is called when every process is warmed up and about to measure."""
        if self._pool is None:
            result: Result = _event_loop_run(run_phase(phase, on_start))
            return result
        wait = phase.timeout + 60
        pending = [self._pool.apply_async(_worker_phase, (part, wait)) for part in split(phase, self.processes)]
        try:
            self._barrier.wait(wait)
            on_start()
            merged = Result()
            for part in pending:
                merged.merge(part.get(timeout=wait))
            return merged
        finally:
            self._barrier.reset()

    def close(self, abort: bool = False) -> None:
        """Stop the worker processes: at once with ``abort`` (their requests in flight are dropped)."""
        if self._pool is not None:
            if abort:
                self._pool.terminate()
            else:
                self._pool.close()
            self._pool.join()
