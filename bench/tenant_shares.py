"""Tenant limits behind an L4 balancer: what the fleet admits when a tenant's traffic falls unevenly on the replicas,
against what one replica holding the whole limit admits.

    python -m bench.tenant_shares            # about 5 min; --quick: about 1 min
    python -m bench.tenant_shares --build before=../wt-main --build after=.   # two builds, alternated
    python -m bench.tenant_shares --json

etcd, one simulated mixed node, R replicas (``--replicas``, default 2 and 4; R = 1 is the reference, run with the
first build) sharing one key file. One tenant per limit and pattern runs at once for ``--seconds``:

- limits: ``rpm`` (``--rpm``), ``tpm`` (``--tpm``, tokens from the answers' ``usage``), ``concurrency``
  (``--concurrency``, streams of about half a second from that many closed-loop workers and two more; what it was
  admitted is the stream-seconds its requests held slots, as the replicas count them);
- patterns: ``one``: every request through replica 1 (one kept-alive connection, or a balancer hashing by
  source); ``split``: 90 % through replica 1, 10 % through replica 2; ``even``: 50/50; ``moved``: replica 1 for
  the first half, then replica 2; ``hop``: a new connection every 5 s, to the next replica; ``pause``: half the
  limit at once through replica 1 (concurrency: 5 s of streams), ``--pause`` s of nothing, then the rest of the
  run through replica 2;
  ``burst``: twice the limit at once through replica 1 (a new tenant's first burst), then as ``one``; ``all``: a
  whole limit at once through every replica at the same moment, then spread evenly (the upper bound).

Rate tenants ask at ``--demand`` times their limit (open loop) outside their bursts. For each tenant and R the
report gives what was admitted over the run against the same tenant with R = 1 (``minute``, and the difference
in units: requests, tokens, stream-seconds), the same from 2 s on (``after_2s``), the lowest and highest ratio of
the running totals from 2 s on, how far the running total ever got ahead of the reference (``ahead``, units)
and past a full bucket and its refill (``past_bucket``: the limit plus a 60th of it a second; at most one
request's tokens over for tpm, as with one replica), for concurrency the most requests the replicas ran at once
(their ``vllm_proxy_tenant_in_flight`` summed every 0.25 s), and the puts per replica per second (etcd's
revision over the run).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.procs import (
    Fleet,
    Server,
    add_run_flags,
    checkout_arg,
    code_version,
    machine,
    parse_quick,
    report_and_exit_status,
)
from bench.scale_etcd import etcd_command

MODEL = "sim-model"
PATTERNS = ("one", "split", "even", "moved", "hop", "pause", "burst", "all")
KINDS = ("rpm", "tpm", "concurrency")
QUICK = {"seconds": 20.0, "replicas": [2]}
RETRY = 0.1
"""Seconds a concurrency worker waits after a 429 before it asks again."""
HOP = 5.0
"""Seconds between two connections of a ``hop`` tenant."""
SAMPLE = 0.25
"""Seconds between two looks at the concurrency tenants' requests in flight on the replicas."""


@dataclass
class Tally:
    """One tenant's admissions: (seconds since the start, units) of each admitted request (a request, or its
    tokens); for concurrency, (seconds, stream-seconds) every ``SAMPLE`` s from the replicas' counts, and the peak
    they showed."""

    admitted: list[tuple[float, float]] = field(default_factory=list)
    refused: int = 0
    failed: int = 0
    peak: int = 0

    def totals(self, seconds: float) -> list[float]:
        """Units admitted by each whole second of the run (index 0: by 1 s); for concurrency, the stream-seconds
        its slots were used."""
        out = [0.0] * int(seconds)
        for at, units in self.admitted:
            for second in range(max(0, int(at)), len(out)):
                out[second] += units
        return out


@dataclass(frozen=True)
class Tenant:
    kind: str
    pattern: str

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.pattern}"

    def replica(self, replicas: int, at: float, index: int, args: argparse.Namespace) -> int | None:
        """Which replica the ``index``-th request, sent ``at`` s into the run, goes through (None: none is sent
        now, the ``pause``)."""
        pattern, seconds = self.pattern, args.seconds
        if pattern == "pause":  # rates: half the limit at once first (the burst); concurrency: streams for 5 s
            first = 5.0 if self.kind == "concurrency" else 0.0
            if at < first or at >= first + args.pause:
                return 0 if at < first else min(1, replicas - 1)
            return None
        if replicas == 1 or pattern in ("one", "burst"):
            return 0
        if pattern == "split":
            return 1 if index % 10 == 9 else 0
        if pattern == "even":
            return index % 2
        if pattern == "moved":
            return 0 if at < seconds / 2 else 1
        if pattern == "hop":
            return int(at / HOP) % replicas
        return index % replicas  # all


def key_file(args: argparse.Namespace) -> str:
    limits = {"rpm": args.rpm, "tpm": args.tpm, "concurrency": args.concurrency}
    return "".join(
        f"{t.name}-key tenant={t.name} {t.kind}={limits[t.kind]}\n"
        for t in (Tenant(k, p) for k in KINDS for p in args.patterns)
    )


async def ask(client: httpx.AsyncClient, key: str, body: dict[str, Any], tally: Tally, at: float, kind: str) -> None:
    """One request; admitted ones are counted in the tenant's units (a request, or its tokens)."""
    try:
        answer = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    except httpx.HTTPError:
        tally.failed += 1
        return
    if answer.status_code == 429:
        tally.refused += 1
    elif answer.status_code != 200:
        tally.failed += 1
    elif kind == "tpm":
        usage = answer.json()["usage"]
        tally.admitted.append((at, usage["prompt_tokens"] + usage["completion_tokens"]))
    else:
        tally.admitted.append((at, 1))


def burst_size(tenant: Tenant, args: argparse.Namespace) -> tuple[int, list[int]]:
    """How many requests a rate tenant sends at once at the start, and through which replicas (one each)."""
    per_limit = args.rpm if tenant.kind == "rpm" else args.tpm // args.tokens_per_request
    if tenant.pattern == "burst":
        return 2 * per_limit, [0]
    if tenant.pattern == "pause":
        return per_limit // 2, [0]
    if tenant.pattern == "all":
        return per_limit, list(range(args.replica_count))
    return 0, []


async def open_loop(
    tenant: Tenant, clients: list[httpx.AsyncClient], rate: float, args: argparse.Namespace, tally: Tally
) -> None:
    """The tenant's burst at the start, if its pattern has one, then requests at ``rate`` a second, evenly
    spaced, whatever the answers take."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": args.tokens}
    key, started = f"{tenant.name}-key", time.monotonic()
    size, through = burst_size(tenant, args)
    tasks = [
        asyncio.create_task(ask(clients[replica], key, body, tally, 0.0, tenant.kind))
        for replica in through
        if replica < len(clients)
        for _ in range(size)
    ]
    index = 0
    while (at := index / rate) < args.seconds:
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        replica = tenant.replica(len(clients), at, index, args)
        if replica is not None:
            tasks.append(asyncio.create_task(ask(clients[replica], key, body, tally, at, tenant.kind)))
        index += 1
    await asyncio.gather(*tasks)


async def stream_once(client: httpx.AsyncClient, key: str, tally: Tally, tokens: int) -> bool:
    """One stream held to its end; False when refused."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": key}) as answer:
            if answer.status_code == 429:
                tally.refused += 1
                await answer.aread()
                return False
            if answer.status_code != 200:
                tally.failed += 1
                await answer.aread()
                return False
            async for _ in answer.aiter_raw():
                pass
    except httpx.HTTPError:
        tally.failed += 1
    return True


async def closed_loop(tenant: Tenant, clients: list[httpx.AsyncClient], args: argparse.Namespace, tally: Tally) -> None:
    """``--concurrency`` + 2 workers, each streaming one request after another (a pause after a 429); ``burst``
    starts with twice as many for its first 5 s, ``all`` deals its workers over the replicas."""
    started, key = time.monotonic(), f"Bearer {tenant.name}-key"
    workers = args.concurrency + 2

    async def worker(number: int) -> None:
        index = number
        while (at := time.monotonic() - started) < args.seconds:
            if number >= workers and at > 5:
                return  # the burst's extra workers
            replica = tenant.replica(len(clients), at, index, args)
            if tenant.pattern == "all":
                replica = number % len(clients)
            if replica is None:
                await asyncio.sleep(RETRY)
                continue
            index += 1
            if not await stream_once(clients[replica], key, tally, args.stream_tokens):
                await asyncio.sleep(RETRY)

    count = 2 * workers if tenant.pattern == "burst" else workers
    await asyncio.gather(*(worker(n) for n in range(count)))


IN_FLIGHT = re.compile(rb'^vllm_proxy_tenant_in_flight\{tenant="([^"]+)"\} (\S+)$', re.MULTILINE)


async def in_flight(urls: list[str], tallies: dict[str, Tally], seconds: float) -> None:
    """Every ``SAMPLE`` s, each concurrency tenant's requests in flight as the replicas count them (their
    ``vllm_proxy_tenant_in_flight``, summed): its stream-seconds and its peak."""
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as client:
        while (at := time.monotonic() - started) < seconds:
            pages = await asyncio.gather(*(client.get(url + "/metrics") for url in urls))
            counts: dict[str, float] = {}
            for page in pages:
                for tenant, value in IN_FLIGHT.findall(page.content):
                    counts[tenant.decode()] = counts.get(tenant.decode(), 0.0) + float(value)
            for name, count in counts.items():
                if name in tallies:
                    tallies[name].admitted.append((at, count * SAMPLE))
                    tallies[name].peak = max(tallies[name].peak, int(count))
            await asyncio.sleep(max(0.0, started + at + SAMPLE - time.monotonic()))


async def load(urls: list[str], args: argparse.Namespace) -> dict[str, Tally]:
    tallies = {Tenant(k, p).name: Tally() for k in KINDS for p in args.patterns}
    # A client per tenant and replica, each with few connections: httpcore's pool looks at every connection it
    # holds, for each of them, at every request.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    clients = {name: [httpx.AsyncClient(base_url=url, timeout=60, limits=limits) for url in urls] for name in tallies}
    rates = {"rpm": args.rpm * args.demand / 60, "tpm": args.tpm * args.demand / 60 / args.tokens_per_request}
    try:
        work = []
        for kind in KINDS:
            for pattern in args.patterns:
                tenant = Tenant(kind, pattern)
                mine, tally = clients[tenant.name], tallies[tenant.name]
                if kind == "concurrency":
                    work.append(closed_loop(tenant, mine, args, tally))
                else:
                    work.append(open_loop(tenant, mine, rates[kind], args, tally))
        concurrency = {name: tally for name, tally in tallies.items() if name.startswith("concurrency")}
        work.append(in_flight(urls, concurrency, args.seconds))
        await asyncio.gather(*work)
    finally:
        for client in (c for per_tenant in clients.values() for c in per_tenant):
            await client.aclose()
    return tallies


def revision(server: Server) -> int:
    return int(httpx.get(server.url + "/status", timeout=5).json()["discovery"]["revision"])


def run_once(args: argparse.Namespace, replicas: int, build: str, checkout: Path) -> dict[str, Any]:
    logs = args.logs / f"{build}-r{replicas}" if args.logs else None
    with Fleet(keep_logs=logs) as fleet:
        keys = fleet.log_dir / "keys.txt"
        keys.write_text(key_file(args))
        peer = fleet.port()
        etcd = fleet.start(
            "etcd", "", [], "/health", command=lambda port: etcd_command(fleet.log_dir / "etcd-data", port, peer)
        )
        sim_flags = ["--role", "mixed", "--ttft", "0.005", "--itl", str(args.itl), "--output-len", "1000"]
        sim_flags += ["--log-level", "warning"]
        node = fleet.start("node", "vllm_etcd_proxy.sim", sim_flags, "/health")
        fleet.wait_ready()
        flags = ["--etcd", etcd.url, "--mixed", f"127.0.0.1:{node.port}", "--model", MODEL, "--api-key-file", str(keys)]
        servers = [
            fleet.start(
                f"replica{i}", "vllm_etcd_proxy.proxy", [*flags, "--log-level", "warning"], "/ready", cwd=checkout
            )
            for i in range(replicas)
        ]
        fleet.wait_ready()
        _wait_counted(servers, replicas)
        first = revision(servers[0])
        started = time.monotonic()
        args.replica_count = replicas
        tallies = asyncio.run(load([s.url for s in servers], args))
        elapsed = time.monotonic() - started
        puts = (revision(servers[0]) - first) / replicas
    return {
        "replicas": replicas,
        "build": build,
        "tallies": tallies,
        "puts_per_replica_second": round(puts / elapsed, 2),
        "puts_per_replica": round(puts, 2),
        "seconds": round(elapsed, 2),
    }


def _wait_counted(servers: list[Server], replicas: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for server in servers:
        while httpx.get(server.url + "/status", timeout=5).json()["replicas"]["count"] != replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{server.name} does not see {replicas} replicas")
            time.sleep(0.1)
    time.sleep(2)  # every record is a second old: as in a fleet that has run a while


def compare(tally: Tally, reference: Tally, seconds: float, limit: int | None) -> dict[str, Any]:
    """The tenant's admissions against the reference's (R = 1): over the run, and the running totals from 2 s;
    for rpm and tpm (``limit``), how far the running total ever got past a full bucket and its refill."""
    mine, ref = tally.totals(seconds), reference.totals(seconds)
    past = None if limit is None else max(m - limit * (1 + (t + 1) / 60) for t, m in enumerate(mine))
    ratios = [m / r for m, r in zip(mine[1:], ref[1:], strict=True) if r]  # index 1: by 2 s
    later, ref_later = mine[-1] - mine[1], ref[-1] - ref[1]
    return {
        "admitted": mine[-1],
        "reference": ref[-1],
        "minute": round(mine[-1] / ref[-1], 3) if ref[-1] else None,
        "difference": round(mine[-1] - ref[-1], 1),
        "after_2s": round(later / ref_later, 3) if ref_later else None,
        "from_2s": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
        "ahead": round(max(m - r for m, r in zip(mine, ref, strict=True)), 1),
        "past_bucket": None if past is None else round(past, 1),
        "refused": tally.refused,
        "peak_in_flight": tally.peak,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    started, loadavg = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), Path("/proc/loadavg").read_text().split()[0]
    builds: dict[str, Path] = args.build
    first = next(iter(builds))
    reference = run_once(args, 1, first, builds[first])["tallies"]
    runs = []
    for count in sorted(set(args.replicas) - {1}):
        for build, checkout in builds.items():  # builds alternate at each fleet size: a noisy minute hits both
            runs.append(run_once(args, count, build, checkout))
    fleets, limits = {}, {"rpm": args.rpm, "tpm": args.tpm}
    for done in runs:
        tenants = {
            name: compare(t, reference[name], args.seconds, limits.get(name.split("-")[0]))
            for name, t in done["tallies"].items()
        }
        fleets[f"{done['build']}/{done['replicas']}"] = {
            "build": done["build"],
            "replicas": done["replicas"],
            "puts_per_replica_second": done["puts_per_replica_second"],
            "puts_per_replica": done["puts_per_replica"],
            "seconds": done["seconds"],
            "tenants": tenants,
        }
    failed = sum(t.failed for done in runs for t in done["tallies"].values())
    config = {k: v for k, v in vars(args).items() if k not in ("logs", "save", "json", "quick", "replica_count")}
    config["build"] = {name: str(path) for name, path in builds.items()}
    return {
        "ok": failed == 0,
        "failed": failed,
        "code": code_version(),
        "machine": machine(started, loadavg),
        "config": config,
        "reference": {name: t.totals(args.seconds)[-1] for name, t in reference.items()},
        "fleets": fleets,
    }


def render(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"rpm={c['rpm']}, tpm={c['tpm']}, concurrency={c['concurrency']}; rate tenants ask {c['demand']}x their "
        f"limit; {c['seconds']} s a run; code {report['code']}",
        "",
        "| build | R | tenant | admitted | R=1 | over the run | difference | after 2 s "
        "| running totals from 2 s (min, max) | most ahead | past a bucket | peak in flight | puts / replica / s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fleet in report["fleets"].values():
        for name, t in fleet["tenants"].items():
            peak = t["peak_in_flight"] if name.startswith("concurrency") else ""
            spread = "" if t["from_2s"] is None else f"{t['from_2s'][0]}, {t['from_2s'][1]}"
            lines.append(
                f"| {fleet['build']} | {fleet['replicas']} | {name} | {t['admitted']:.0f} | {t['reference']:.0f} "
                f"| {t['minute']} | {t['difference']} | {t['after_2s']} | {spread} | {t['ahead']} "
                f"| {'' if t['past_bucket'] is None else t['past_bucket']} | {peak} "
                f"| {fleet['puts_per_replica_second']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tenant_shares", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--replicas", type=int, nargs="+", default=[2, 4], help="fleet sizes to run (R = 1 always runs first)")
    add("--seconds", type=float, default=60.0, help="seconds of load per fleet (default 60)")
    add("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS), help="the tenants' patterns (all)")
    add(
        "--build", type=checkout_arg, action="append", help="NAME=CHECKOUT to run the replicas from (default: this one)"
    )
    add("--rpm", type=int, default=60, help="the rpm tenants' limit (default 60)")
    add("--tpm", type=int, default=3000, help="the tpm tenants' limit (default 3000)")
    add("--concurrency", type=int, default=10, help="the concurrency tenants' limit (default 10)")
    add("--demand", type=float, default=2.0, help="rate tenants ask this many times their limit (default 2)")
    add("--pause", type=float, default=8.0, help="seconds a pause tenant asks nothing (default 8)")
    add("--tokens", type=int, default=16, help="max_tokens of the rate tenants' requests (default 16)")
    add("--tokens-per-request", type=int, default=30, help="tokens a tpm request costs, for its rate (default 30)")
    add("--stream-tokens", type=int, default=50, help="tokens of a concurrency tenant's stream (default 50)")
    add("--itl", type=float, default=0.01, help="the node's seconds between tokens (default 0.01)")
    add_run_flags(parser, QUICK, "short runs, R = 1 and 2")
    args = parse_quick(parser, argv, QUICK)
    args.build = dict(args.build or [("this", Path(".").resolve())])
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    raise SystemExit(main())
