"""KV-event ingest at fleet scale: one replica subscribed to many publishers while requests route on its index.

    python -m bench.kv_ingest [--publishers 200] [--rate 50] [--seconds 20] [--rounds 2] [--baseline DIR]
                              [--repeat N] [--pin] [--profile DIR [--native]] [--quick] [--json]

``--publishers`` simulated nodes (bench/kv_fleet.py, in processes apart from the replica, ``--per-process`` each)
publish vLLM 0.32's exact frames, ``--rate`` batches a second each of 1-8 blocks (and, once a node holds
``--capacity`` blocks, a removal of as many in the same batch); their HTTP ports (one more process) answer
completions at once. One vllm-proxy replica has them all as static nodes with ``--kv-events`` (kv-aware policy,
``--scrape-load 0``). Each node's first batch stores a probe prefix of its own, which the replica takes in by
replay; the requests (token-id completions, one at a time, ``--requests-per-second``) each extend one node's probe,
so kv-aware must send each to that node ("misrouted" counts those that went elsewhere).

Each round is a quiet phase (no events flowing) and a flowing phase of ``--seconds`` each, with the same requests:
- requests' latency at the client, p50 / p99, flowing against quiet ("added");
- the replica's CPU (all threads of its process tree, from /proc schedstat), flowing less quiet: the ingest's cores;
- lag from publish to index: each node's ``lag_seconds`` on /list_workers (the publish timestamp in its last batch
  against the moment it was applied), sampled every ``--sample-every`` seconds in both phases;
- after the rounds, every node's batches applied, gaps, replays, malformed frames, blocks indexed and orphans
  against what its publisher sent and holds: "lost" and "misread" must be 0.
``--baseline DIR`` runs the same rounds first with the replica's code taken from DIR (a checkout, e.g. ``git
worktree add /tmp/base main``; this interpreter, ``PYTHONPATH=DIR``), so before and after come from one run;
``--repeat N`` runs them N times in turn. ``--pin``: the replica on CPU 0, the rest on CPU 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import httpx

from bench.kv_fleet import MODEL, probe_ids
from bench.procs import (
    HOST,
    Fleet,
    Server,
    add_run_flags,
    code_version,
    die_with_parent,
    machine,
    parse_quick,
    pin,
    report_and_exit_status,
)

QUICK = {"publishers": 8, "per_process": 4, "rate": 20.0, "seconds": 1.5, "rounds": 1, "requests_per_second": 20.0}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_ingest", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--publishers", type=int, default=200, help="simulated nodes publishing KV events (200)")
    add("--per-process", type=int, default=50, help="publishers per process (50)")
    add("--rate", type=float, default=50.0, help="batches a second per publisher while flowing (50)")
    add("--block-size", type=int, default=16)
    add("--capacity", type=int, default=1000, help="blocks a node holds before it evicts (1000)")
    add("--buffer", type=int, default=2000, help="batches each publisher keeps for replay (2000)")
    add("--seconds", type=float, default=20.0, help="length of each measured phase (20)")
    add("--warmup", type=float, default=2.0, help="seconds of flow before a flowing phase is measured (2)")
    add("--rounds", type=int, default=2, help="quiet + flowing phase pairs per replica (2)")
    add("--requests-per-second", type=float, default=40.0, help="requests through the replica, one at a time (40)")
    add("--sample-every", type=float, default=1.0, help="seconds between /list_workers samples (1)")
    add("--baseline", type=Path, help="also run the replica from this checkout first (the code before)")
    add("--pin", action="store_true", help="the replica on CPU 0, the simulated fleet and this process on CPU 1")
    add("--repeat", type=int, default=1, help="run the replicas (before, after, ...) this many times, in turn (1)")
    add("--profile", type=Path, help="py-spy the replica through each first flowing phase, into this directory")
    add("--native", action="store_true", help="with --profile: C frames too (pyzmq, msgspec, the interpreter)")
    add_run_flags(p, QUICK, "a smoke run")
    args = parse_quick(p, argv, QUICK)
    if min(args.publishers, args.per_process, args.rounds, args.block_size, args.capacity) < 1:
        p.error("counts must be at least 1")
    if min(args.rate, args.seconds, args.requests_per_second, args.sample_every) <= 0:
        p.error("rates and durations must be positive")
    return args


# -- the simulated fleet ------------------------------------------------------------------------------------------


class Child:
    """A bench.kv_fleet process driven over its stdin and stdout, one JSON line each way."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path) -> None:
        self.name = name
        self._log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "bench.kv_fleet", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            preexec_fn=die_with_parent,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self._in: IO[bytes] = self.popen.stdin
        self._out: IO[bytes] = self.popen.stdout

    def read(self) -> Any:
        line = self._out.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited with {self.popen.wait()}: see its log")
        return json.loads(line)

    def ask(self, message: dict[str, Any]) -> Any:
        self._in.write(json.dumps(message).encode() + b"\n")
        self._in.flush()
        return self.read()

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)
        self._in.close()
        self._out.close()
        self._log.close()


class SimFleet:
    """The publishers' processes and the nodes' HTTP process; ``nodes[i]`` is node i's (http, events, replay)."""

    def __init__(self, fleet: Fleet, args: argparse.Namespace, name: str) -> None:
        self.args = args
        self.nodes = [(fleet.port(), fleet.port(), fleet.port()) for _ in range(args.publishers)]
        self.children: list[Child] = []
        config = {"block_size": args.block_size, "capacity": args.capacity, "buffer": args.buffer}
        for first in range(0, args.publishers, args.per_process):
            mine = [
                {"index": i, "events": self.nodes[i][1], "replay": self.nodes[i][2]}
                for i in range(first, min(first + args.per_process, args.publishers))
            ]
            spec = json.dumps({**config, "publishers": mine})
            self.children.append(Child(f"{name}-publishers{len(self.children)}", ["publish", spec], fleet.log_dir))
        self.publishers = list(self.children)
        self.children.append(Child(f"{name}-answers", ["answer", *(str(n[0]) for n in self.nodes)], fleet.log_dir))
        for child in self.children:
            child.read()  # bound, or listening

    def address(self, i: int) -> str:
        return f"{HOST}:{self.nodes[i][0]}"

    def kv_flags(self) -> list[str]:
        return [f"{self.address(i)}=tcp://{HOST}:{ev},tcp://{HOST}:{rp}" for i, (_, ev, rp) in enumerate(self.nodes)]

    def set_rate(self, rate: float) -> None:
        for child in self.publishers:
            child.ask({"rate": rate})

    def report(self) -> dict[int, dict[str, int]]:
        return {p["index"]: p for child in self.publishers for p in child.ask({"report": True})}

    def stop(self) -> None:
        for child in self.children:
            child.stop()


# -- the replica --------------------------------------------------------------------------------------------------


def tree_cpu_ns(pid: int) -> int:
    """CPU of a live process's threads and of its descendants' so far, in ns (schedstat's first field)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        tasks = Path(f"/proc/{current}/task")
        try:
            for task in tasks.iterdir():
                total += int((task / "schedstat").read_text().split()[0])
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def threads_cpu_ns(pid: int) -> dict[str, int]:
    """CPU so far of a live process's threads by name (ZMQ's I/O threads, the event loop's, ...), in ns."""
    found: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            found[name] = found.get(name, 0) + int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def resident_mib(pid: int) -> float:
    """Resident memory of a process and its descendants, MiB."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1024


class Requests:
    """Token-id completions through the replica on one kept connection, each extending one node's probe."""

    def __init__(self, port: int, sim: SimFleet, block_size: int) -> None:
        self.sock = socket.create_connection((HOST, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sim, self.block_size = sim, block_size
        self.sent = 0

    def one(self) -> tuple[float, bool]:
        """(latency in seconds, whether it went to the node holding its prefix)."""
        node = self.sent % len(self.sim.nodes)
        self.sent += 1
        ids = [*probe_ids(node, self.block_size), 7, self.sent % 1000]
        body = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 1}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        head += f"content-length: {len(body)}\r\n\r\n"
        started = time.perf_counter()
        self.sock.sendall(head.encode() + body)
        status, headers = self._response()
        took = time.perf_counter() - started
        if status != 200:
            raise RuntimeError(f"a request answered {status}")
        return took, headers.get("x-sim-node") == self.sim.address(node)

    def _response(self) -> tuple[int, dict[str, str]]:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("the replica closed the connection")
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            rest += self.sock.recv(65536)
        return int(lines[0].split()[1]), headers


def applied(client: httpx.Client) -> float:
    """KV-event batches the replica applied so far (its /metrics counter)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("vllm_proxy_kv_event_batches_total "):
            return float(line.split()[1])
    return 0.0


def workers(client: httpx.Client) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = client.get("/list_workers").json()["workers"]
    return found


def start_replica(fleet: Fleet, sim: SimFleet, name: str, baseline: Path | None) -> Server:
    pool = ["--mixed", *(sim.address(i) for i in range(len(sim.nodes)))]
    argv = [*pool, "--kv-events", *sim.kv_flags(), "--model", MODEL, "--scrape-load", "0", "--log-level", "warning"]
    # PYTHONSAFEPATH: ``python -m`` would put the current directory (this checkout) before PYTHONPATH.
    before = {} if baseline is None else {"PYTHONPATH": str(baseline), "PYTHONSAFEPATH": "1"}
    env = {**os.environ, **before}
    replica = fleet.start(name, "vllm_etcd_proxy.proxy", argv, "/health", env=env)
    replica.wait_ready("/health", 60.0)
    return replica


class NotFollowed(RuntimeError):
    """The replica did not track every node with what it held before (a finding, reported as such)."""


def wait_indexed(client: httpx.Client, count: int, deadline: float) -> None:
    """Until every node is tracked and its probe indexed (the replica replayed every node's first batch)."""
    while True:
        found = workers(client)
        ready = [w for w in found if w["kv_events"]["tracked"] and w["kv_events"]["blocks_indexed"] > 0]
        if len(ready) == count:
            return
        if time.monotonic() > deadline:
            raise NotFollowed(f"only {len(ready)} of {count} nodes tracked with their probe indexed")
        time.sleep(0.2)


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def profiler(replica: Server, args: argparse.Namespace, flowing: bool) -> subprocess.Popen[bytes] | None:
    """py-spy recording the replica (collapsed stacks, all threads, native frames with ``--native``) through
    this phase, when ``--profile`` asks for it and no profile of this replica's flow is there yet."""
    if args.profile is None or not flowing:
        return None
    args.profile.mkdir(parents=True, exist_ok=True)
    out = args.profile / f"{replica.name}.txt"
    if out.exists():
        return None
    spy = Path(sys.executable).with_name("py-spy")
    # Native unwinding stops the process for each sample; without it py-spy reads it as it runs.
    argv = [str(spy), "record", "--threads", "--rate", "200", "--format", "raw"]
    argv += ["--native"] if args.native else ["--nonblocking"]
    argv += ["--duration", str(int(args.seconds)), "--output", str(out), "--pid", str(replica.pid)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def phase(replica: Server, client: httpx.Client, requests: Requests, flowing: bool, args: argparse.Namespace) -> Any:
    """One measured phase: requests at their rate, /list_workers sampled, the replica's CPU over it."""
    sim = requests.sim
    if flowing:
        sim.set_rate(args.rate)
        time.sleep(args.warmup)  # the flow settles (connections busy, buffers warm) before it is measured
    sent0, applied0 = sum(p["sent"] for p in sim.report().values()), applied(client)
    latencies: list[float] = []
    lags: list[float] = []
    misrouted = 0
    spy = profiler(replica, args, flowing)
    t0, cpu0, threads0 = time.perf_counter(), tree_cpu_ns(replica.pid), threads_cpu_ns(replica.pid)
    next_request, next_sample, end = t0, t0 + args.sample_every, t0 + args.seconds
    while (now := time.perf_counter()) < end:
        if now >= next_sample:
            next_sample += args.sample_every
            fresh = 2.0 / args.rate + 0.5
            for w in workers(client):
                kv = w["kv_events"]
                ago = kv["last_event_seconds_ago"]
                if kv["lag_seconds"] is not None and ago is not None and ago <= fresh:
                    lags.append(kv["lag_seconds"])
            continue
        if now < next_request:
            time.sleep(min(next_request, next_sample) - now)
            continue
        next_request += 1 / args.requests_per_second
        took, right = requests.one()
        latencies.append(took)
        misrouted += not right
    t1, cpu1, threads1 = time.perf_counter(), tree_cpu_ns(replica.pid), threads_cpu_ns(replica.pid)
    if spy is not None:
        spy.wait(args.seconds + 30)
    sent1, applied1 = sum(p["sent"] for p in sim.report().values()), applied(client)
    if flowing:
        sim.set_rate(0)
    return {
        "seconds": t1 - t0,
        "cpu_s": (cpu1 - cpu0) / 1e9,
        "threads_s": {k: (v - threads0.get(k, 0)) / 1e9 for k, v in threads1.items()},
        "latencies": latencies,
        "misrouted": misrouted,
        "lags": lags,
        "batches_sent": sent1 - sent0,
        "batches_applied": applied1 - applied0,
    }


def settled(client: httpx.Client, sim: SimFleet, deadline: float) -> tuple[list[dict[str, Any]], dict[int, Any]]:
    """Once every node's last batch is applied (or the deadline passed): the replica's and publishers' views."""
    published = sim.report()
    by_address = {sim.address(i): i for i in range(len(sim.nodes))}
    while True:
        found = workers(client)
        behind = [w for w in found if _last_seq(w) < published[by_address[w["id"]]]["batches"] - 1]
        if not behind or time.monotonic() > deadline:
            return found, published
        time.sleep(0.2)


def _last_seq(worker: dict[str, Any]) -> int:
    seq = worker["kv_events"]["last_seq"]
    return -1 if seq is None else int(seq)


def integrity(found: list[dict[str, Any]], published: dict[int, Any], sim: SimFleet) -> dict[str, int]:
    by_address = {sim.address(i): i for i in range(len(sim.nodes))}
    totals = {"published": 0, "applied": 0, "lost": 0, "misread_nodes": 0}
    for key in ("gaps", "replays", "malformed", "restarts", "orphan_blocks"):
        totals[key] = 0
    for w in found:
        kv, mine = w["kv_events"], published[by_address[w["id"]]]
        totals["published"] += mine["batches"]
        totals["applied"] += kv["batches"]
        totals["lost"] += max(0, mine["batches"] - kv["batches"])
        for key in ("gaps", "replays", "malformed", "restarts", "orphan_blocks"):
            totals[key] += kv[key]
        totals["misread_nodes"] += kv["blocks_indexed"] != mine["held"] or kv["malformed"] > 0
    return totals


def measure(fleet: Fleet, sim: SimFleet, name: str, baseline: Path | None, args: argparse.Namespace) -> Any:
    replica = start_replica(fleet, sim, name, baseline)
    if args.pin:
        replica.pin({0})
        for child in sim.children:
            pin(child.popen.pid, {1})
        os.sched_setaffinity(0, {1})
    try:
        with httpx.Client(base_url=replica.url, timeout=30.0) as client:
            wait_indexed(client, len(sim.nodes), time.monotonic() + 60 + len(sim.nodes) / 20)
            requests = Requests(replica.port, sim, args.block_size)
            for _ in range(min(50, len(sim.nodes))):
                requests.one()  # connections to the nodes open
            phases: dict[str, list[Any]] = {"quiet": [], "flowing": []}
            for _ in range(args.rounds):
                for kind in ("quiet", "flowing"):
                    phases[kind].append(phase(replica, client, requests, kind == "flowing", args))
            found, published = settled(client, sim, time.monotonic() + 30)
            memory = resident_mib(replica.pid)
            blocks = sum(w["kv_events"]["blocks_indexed"] for w in found)
    finally:
        replica.stop()
    return summary(phases, integrity(found, published, sim), memory, blocks)


def summary(phases: dict[str, list[Any]], checks: dict[str, int], memory: float, blocks: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, runs in phases.items():
        latencies = [x for r in runs for x in r["latencies"]]
        seconds = sum(r["seconds"] for r in runs)
        lags = [x for r in runs for x in r["lags"]]
        out[kind] = {
            "requests": len(latencies),
            "latency_p50_ms": round(statistics.median(latencies) * 1e3, 3),
            "latency_p99_ms": round(quantile(latencies, 0.99) * 1e3, 3),
            "latency_max_ms": round(max(latencies) * 1e3, 3),
            "misrouted": sum(r["misrouted"] for r in runs),
            "replica_cores": round(sum(r["cpu_s"] for r in runs) / seconds, 3),
            "thread_cores": {
                name: round(sum(r["threads_s"].get(name, 0.0) for r in runs) / seconds, 3)
                for name in sorted({n for r in runs for n in r["threads_s"]})
            },
            "batches_per_s": round(sum(r["batches_sent"] for r in runs) / seconds),
            "applied_per_s": round(sum(r["batches_applied"] for r in runs) / seconds),
            "lag_samples": len(lags),
            "lag_p50_ms": round(quantile(lags, 0.5) * 1e3, 1) if lags else None,
            "lag_p99_ms": round(quantile(lags, 0.99) * 1e3, 1) if lags else None,
        }
    quiet, flowing = out["quiet"], out["flowing"]
    out["added_p50_ms"] = round(flowing["latency_p50_ms"] - quiet["latency_p50_ms"], 3)
    out["added_p99_ms"] = round(flowing["latency_p99_ms"] - quiet["latency_p99_ms"], 3)
    out["ingest_cores"] = round(flowing["replica_cores"] - quiet["replica_cores"], 3)
    # What a batch costs, whether or not the replica kept up (one that falls behind applies fewer than came).
    out["ingest_us_per_batch"] = round(out["ingest_cores"] / max(1, flowing["applied_per_s"]) * 1e6, 1)
    out["integrity"] = checks
    out["resident_mib"] = round(memory, 1)
    out["blocks_indexed"] = blocks
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    loadavg = Path("/proc/loadavg").read_text().split()[0]
    report: dict[str, Any] = {
        "code": code_version(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("save",)},
        "replicas": {},
    }
    pids: dict[str, int] = {}
    with Fleet(keep_logs=args.logs) as fleet:
        variants: list[tuple[str, Path | None]] = [("before", args.baseline)] if args.baseline else []
        variants.append(("after", None))
        runs = variants if args.repeat == 1 else [(f"{n}-{i + 1}", b) for i in range(args.repeat) for n, b in variants]
        for name, baseline in runs:
            # Publishers of its own for each replica: each gets the probes by replay, as the first one did.
            sim = SimFleet(fleet, args, name)
            try:
                report["replicas"][name] = measure(fleet, sim, f"replica-{name}", baseline, args)
            except NotFollowed as exc:
                report["replicas"][name] = {"error": str(exc)}
            finally:
                sim.stop()
            pids |= {c.name: c.popen.pid for c in sim.children}
        pids |= {s.name: s.pid for s in fleet.servers}
    report["server_pids"] = pids
    report["machine"] = machine(started, loadavg)
    measured = [r for name, r in report["replicas"].items() if "error" not in r or not name.startswith("before")]
    report["ok"] = all(
        "error" not in r and r["integrity"]["lost"] == r["integrity"]["misread_nodes"] == r["quiet"]["misrouted"] == 0
        for r in measured
    )
    return report


def render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        f"{cfg['publishers']} publishers x {cfg['rate']:g} batches/s, {cfg['rounds']} rounds of {cfg['seconds']:g} s "
        f"quiet + flowing; code {report['code']}; load {report['machine']['loadavg_start']} -> "
        f"{report['machine']['loadavg_end']}",
        f"{'replica':>8} {'batches/s':>9} {'ingest cores':>12} {'lag p50/p99 ms':>15} "
        f"{'quiet p50/p99 ms':>17} {'flowing p50/p99 ms':>19} {'added p50/p99':>14} {'misrouted':>9} "
        f"{'lost':>5} {'misread':>7} {'RSS MiB':>8}",
    ]
    for name, r in report["replicas"].items():
        if "error" in r:
            lines.append(f"{name:>8} {r['error']}")
            continue
        q, f, i = r["quiet"], r["flowing"], r["integrity"]
        lines.append(
            f"{name:>8} {f['batches_per_s']:>9} {r['ingest_cores']:>12} "
            f"{f['lag_p50_ms']!s:>7}/{f['lag_p99_ms']!s:<7} {q['latency_p50_ms']:>8}/{q['latency_p99_ms']:<8} "
            f"{f['latency_p50_ms']:>9}/{f['latency_p99_ms']:<9} {r['added_p50_ms']:>6}/{r['added_p99_ms']:<7} "
            f"{q['misrouted'] + f['misrouted']:>9} {i['lost']:>5} {i['misread_nodes']:>7} {r['resident_mib']:>8}"
        )
        lines.append(
            f"{'':>8} applied {f['applied_per_s']} batches/s, {r['ingest_us_per_batch']} us of CPU each; "
            f"gaps {i['gaps']}, replays {i['replays']}, malformed {i['malformed']}, restarts {i['restarts']}, "
            f"orphans {i['orphan_blocks']}; {r['blocks_indexed']:,} blocks indexed; replica cores quiet "
            f"{q['replica_cores']}, flowing {f['replica_cores']} (by thread: {f['thread_cores']})"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    sys.exit(main())
