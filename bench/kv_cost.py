"""What routing on KV-cache events costs a replica, end to end on real processes: CPU per chat request with
events and tokenizing, against the same request without them, and CPU per 1,000 events taken in through ZMQ.

    python -m bench.kv_cost [--conversations 24] [--nodes 3] [--ingest-requests 1500] [--quick] [--json]

Two stacks side by side on 127.0.0.1, each of ``--nodes`` vllm-sim nodes (prefix cache, the simulator's Hugging
Face tokenizer, no generation delay) and one vllm-proxy replica (default policy, ``--scrape-load 0``):
- events on: the nodes publish KV-cache events, the replica subscribes (``--kv-events NODE=...``) and tokenizes
  chats (``--tokenizer sim-model=DIR``): kv-aware routing;
- events off: the nodes publish nothing and their cards' root is no tokenizer directory: content affinity, as
  a fleet without the feature.
Each conversation (a ~1,000-word document as the system message, shared by all, then ``--turns`` user turns of
150 words, each answered in 16 tokens: ~2,000 tokens at turn 6) goes to both stacks, turn by turn in turn
(which one first alternates per conversation), one request at a time, non-streamed. A request's CPU is its
replica's (every thread, in ns, from /proc/PID/task/*/schedstat) from just before it is sent to just after its
response is read; "between" is from the end of one of its requests to the start of its next.
Ingest: with no requests through the replicas, ``--ingest-requests`` token-id completions of 1-8 fresh blocks go
straight to one publishing node, 8 at a time, so its cache fills and evicts; the events-on replica's CPU over
that, less its idle rate, divided by the events its /metrics counted.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.procs import HOST, Fleet, Server, add_run_flags, code_version, machine, parse_quick, report_and_exit_status
from bench.tokenize_cost import words
from vllm_etcd_proxy.sim import tokens, vocab

MODEL = "sim-model"
BLOCK = 16
QUICK = {"conversations": 2, "nodes": 2, "ingest_requests": 150, "idle_seconds": 0.5}
SIDES = ("events_on", "events_off")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=24, help="conversations measured on each side (24)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--nodes", type=int, default=3, help="vllm-sim nodes of each stack (3)")
    p.add_argument("--system-words", type=int, default=1000, help="the shared document, in words (1000)")
    p.add_argument("--user-words", type=int, default=150, help="words per user turn (150)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (16)")
    p.add_argument("--ingest-requests", type=int, default=1500, help="requests straight to a node, ingest (1500)")
    p.add_argument("--idle-seconds", type=float, default=2.0, help="idle rate measured over this long (2)")
    add_run_flags(p, QUICK, "a smoke run")
    args = parse_quick(p, argv, QUICK)
    if (
        min(
            args.conversations,
            args.turns,
            args.nodes,
            args.system_words,
            args.user_words,
            args.max_tokens,
            args.ingest_requests,
        )
        < 1
        or args.idle_seconds <= 0
    ):
        p.error("every count must be at least 1 and --idle-seconds positive")
    return args


def cpu_ns(pid: int) -> int:
    """CPU time of a live process's threads so far, in ns (schedstat's first field; utime counts 10 ms ticks).
    A thread that ended meanwhile takes its time with it: the replicas keep their threads."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def samples(client: httpx.Client, url: str) -> dict[str, float]:
    """A Prometheus page's samples: name with its labels -> value."""
    lines = (line.rpartition(" ") for line in client.get(url + "/metrics").text.splitlines() if line[:1] != "#")
    return {name: float(value) for name, _, value in lines if name}


class Chats:
    """The conversations' texts: a shared document, then user turns of their own (the first one tagged)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.system = words(random.Random("document"), args.system_words)
        self.args = args

    def user(self, conversation: int, turn: int) -> str:
        text = words(random.Random(f"{conversation} {turn}"), self.args.user_words)
        tag = hashlib.blake2b(str(conversation).encode(), digest_size=4).hexdigest()
        return f"session {tag}: {text}" if turn == 0 else text


class Side:
    """One stack's replica, its conversations' messages so far and what its requests cost."""

    def __init__(self, name: str, replica: Server, nodes: list[Server]) -> None:
        self.name, self.replica, self.nodes = name, replica, nodes
        self.client = httpx.Client(base_url=replica.url, timeout=30.0)
        self.messages: list[dict[str, str]] = []
        self.cpu: dict[int, list[int]] = {}
        """Turn -> CPU ns of each request."""
        self.between: list[int] = []
        self.prompt_tokens: dict[int, list[int]] = {}
        self.ended: int | None = None

    def chat(self, chats: Chats, conversation: int, turn: int, measured: bool) -> None:
        if turn == 0:
            self.messages = [{"role": "system", "content": chats.system}]
            self.ended = None
        self.messages.append({"role": "user", "content": chats.user(conversation, turn)})
        body = {"model": MODEL, "messages": self.messages, "max_tokens": chats.args.max_tokens, "ignore_eos": True}
        before = cpu_ns(self.replica.pid)
        response = self.client.post("/v1/chat/completions", json=body)
        data = response.json()  # the whole body is read
        after = cpu_ns(self.replica.pid)
        if response.status_code != 200:
            raise SystemExit(f"{self.name}: {response.status_code} {response.text[:300]}")
        if measured:
            self.cpu.setdefault(turn, []).append(after - before)
            self.prompt_tokens.setdefault(turn, []).append(int(data["usage"]["prompt_tokens"]))
            if self.ended is not None:
                self.between.append(before - self.ended)
        self.ended = after
        self.messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})


def stacks(fleet: Fleet, args: argparse.Namespace, tokenizer: Path) -> dict[str, Side]:
    common = [
        "--model",
        MODEL,
        "--ttft",
        "0",
        "--itl",
        "0",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "16384",
        "--tokenizer",
        str(tokenizer),
        "--log-level",
        "warning",
    ]
    nodes: dict[str, list[Server]] = {side: [] for side in SIDES}
    kv_flags: list[str] = []
    for i in range(args.nodes):
        for side in SIDES:
            flags = list(common)
            if side == "events_on":
                events, replay = f"tcp://{HOST}:{fleet.port()}", f"tcp://{HOST}:{fleet.port()}"
                flags += [
                    "--kv-events-config",
                    json.dumps({"enable_kv_cache_events": True, "endpoint": events, "replay_endpoint": replay}),
                ]
            else:  # a card root that is no tokenizer directory: this replica finds no tokenizer
                flags += ["--model-root", f"/models/{MODEL}"]
            node = fleet.start(f"{side}-node{i}", "vllm_etcd_proxy.sim", flags, "/health")
            nodes[side].append(node)
            if side == "events_on":
                kv_flags += ["--kv-events", f"{HOST}:{node.port}={events},{replay}"]
    fleet.wait_ready()
    replicas = {}
    for side in SIDES:
        pool = ["--mixed", *(f"{HOST}:{n.port}" for n in nodes[side])]
        extra = [*kv_flags, "--tokenizer", f"{MODEL}={tokenizer}"] if side == "events_on" else []
        args_ = [*pool, "--model", MODEL, "--scrape-load", "0", "--log-level", "warning", *extra]
        replicas[side] = fleet.start(f"{side}-replica", "vllm_etcd_proxy.proxy", args_, "/ready")
    fleet.wait_ready(60.0)
    return {side: Side(side, replicas[side], nodes[side]) for side in SIDES}


def warm_up(sides: dict[str, Side], chats: Chats, args: argparse.Namespace) -> None:
    """Until the events-on replica tokenizes (its tokenizer loads in a thread), then one whole conversation on
    each side: its first chats are also checked against tokenizing whole, and connections open."""
    on = sides["events_on"]
    deadline = time.monotonic() + 60
    while 'vllm_proxy_prompt_tokenize_total{outcome="whole"}' not in samples(on.client, on.replica.url):
        if time.monotonic() > deadline:
            raise SystemExit(f"the events-on replica never tokenized a chat:\n{on.replica.log_tail()}")
        on.chat(chats, -1, 0, measured=False)
    for side in sides.values():
        for turn in range(args.turns):
            side.chat(chats, -2, turn, measured=False)


FAMILIES = {
    "vllm_proxy_kv_routing_decisions_total": "decision ",
    "vllm_proxy_prompt_tokenize_total": "tokenize ",
    "vllm_proxy_prompt_ids_total": "ids ",
}


def counters(side: Side) -> dict[str, float]:
    """The replica's KV-event counts, routing decisions by reason and tokenizing outcomes."""
    found = samples(side.client, side.replica.url)
    out = {
        "events": found.get("vllm_proxy_kv_events_total", 0),
        "batches": found.get("vllm_proxy_kv_event_batches_total", 0),
    }
    for name, value in found.items():
        family, brace, labels = name.partition("{")
        if brace and family in FAMILIES:
            out[FAMILIES[family] + labels.split('"')[1]] = value
    return out


def placed(nodes: list[Server]) -> dict[str, Any]:
    """Requests each node received (warm-up included) and the nodes' prefix cache hit rate (of prompt tokens)."""
    counted = [httpx.get(n.url + "/sim/requests", timeout=10.0).json()["counters"] for n in nodes]
    hits, queries = (sum(int(c.get(f"prefix_cache_{k}", 0)) for c in counted) for k in ("hits", "queries"))
    return {"node_requests": [int(c.get("received", 0)) for c in counted], "hit_rate": round(hits / max(1, queries), 3)}


async def _direct(url: str, requests: int, seed: int) -> int:
    """``requests`` completions of 1-8 blocks of fresh random token ids, 8 at a time; the blocks sent."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(tokens.FIRST_PROMPT, tokens.VOCAB_SIZE) for _ in range(BLOCK * rng.randint(1, 8))]
        for _ in range(requests)
    ]
    gate = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:

        async def one(prompt: list[int]) -> None:
            async with gate:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                (await client.post("/v1/completions", json=body)).raise_for_status()

        await asyncio.gather(*(one(p) for p in prompts))
    return sum(len(p) for p in prompts) // BLOCK


def ingest(on: Side, off: Side, args: argparse.Namespace) -> dict[str, Any]:
    pid = on.replica.pid
    start = counters(on)
    t0, c0, off0 = time.perf_counter(), cpu_ns(pid), cpu_ns(off.replica.pid)
    time.sleep(args.idle_seconds)
    elapsed = time.perf_counter() - t0
    idle_rate, idle_off = (cpu_ns(pid) - c0) / elapsed, (cpu_ns(off.replica.pid) - off0) / elapsed  # ns a second
    t0, c0 = time.perf_counter(), cpu_ns(pid)
    blocks = asyncio.run(_direct(on.nodes[0].url, args.ingest_requests, seed=7))
    # Until the replica has gone quiet: what it spends in 0.1 s is its idle rate's again (or 10 s passed).
    deadline, last = time.monotonic() + 10, cpu_ns(pid)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = cpu_ns(pid)
        if now - last <= idle_rate * 0.1 * 1.5 + 200_000:
            break
        last = now
    t1, c1 = time.perf_counter(), cpu_ns(pid)
    end = counters(on)
    events, batches = end["events"] - start["events"], end["batches"] - start["batches"]
    net = (c1 - c0) - idle_rate * (t1 - t0)
    return {
        "requests": args.ingest_requests,
        "blocks_stored": blocks,
        "events": int(events),
        "batches": int(batches),
        "seconds": round(t1 - t0, 2),
        "replica_cpu_ms": round((c1 - c0) / 1e6, 1),
        "idle_cpu_ms_per_s": round(idle_rate / 1e6, 2),
        "idle_cpu_ms_per_s_events_off": round(idle_off / 1e6, 2),
        "ms_per_1000_events": round(net / 1e6 / events * 1000, 2) if events else None,
        "ms_per_1000_batches": round(net / 1e6 / batches * 1000, 1) if batches else None,
        "ms_per_1000_blocks_stored": round(net / 1e6 / blocks * 1000, 2),
    }


def quantiles(values: Sequence[int]) -> dict[str, float]:
    """p50 and p90 of ns values, in us (0 for none: one-turn conversations have no time between requests)."""
    ordered = sorted(values) or [0]
    return {
        "p50_us": round(statistics.median(ordered) / 1e3, 1),
        "p90_us": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] / 1e3, 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    loadavg = Path("/proc/loadavg").read_text().split()[0]
    chats = Chats(args)
    with Fleet(keep_logs=args.logs) as fleet:
        sides = stacks(fleet, args, vocab.write(fleet.log_dir / "tokenizer"))
        warm_up(sides, chats, args)
        before = {name: counters(side) for name, side in sides.items()}
        for c in range(args.conversations):
            order = [sides[s] for s in (SIDES if c % 2 == 0 else SIDES[::-1])]
            for turn in range(args.turns):
                for side in order:
                    side.chat(chats, c, turn, measured=True)
        during = {
            name: {k: v - before[name].get(k, 0) for k, v in counters(side).items()} for name, side in sides.items()
        }
        where = {name: placed(side.nodes) for name, side in sides.items()}
        ingested = ingest(sides["events_on"], sides["events_off"], args)
        pids = {s.name: s.pid for s in fleet.servers}
    report: dict[str, Any] = {
        "ok": True,
        "code": code_version(),
        "machine": machine(started, loadavg),
        "config": {k: v for k, v in vars(args).items() if k not in ("save", "logs")},
    }
    requests = args.conversations * args.turns
    for name, side in sides.items():
        every = [ns for per_turn in side.cpu.values() for ns in per_turn]
        report[name] = {
            "request": quantiles(every),
            "between": quantiles(side.between),
            "per_turn": {
                turn + 1: {**quantiles(ns), "prompt_tokens": max(side.prompt_tokens[turn])}
                for turn, ns in sorted(side.cpu.items())
            },
            "events_per_request": round(during[name].get("events", 0) / requests, 2),
            "counters": {k: int(v) for k, v in during[name].items() if v},
            **where[name],
        }
    on, off = report["events_on"]["request"], report["events_off"]["request"]
    report["ratio_p50"] = round(on["p50_us"] / off["p50_us"], 2)
    report["added_p50_us"] = round(on["p50_us"] - off["p50_us"], 1)
    report["ingest"] = ingested
    report["ok"] = ingested["events"] >= ingested["requests"]  # a store per request at least: all were taken in
    report["server_pids"] = pids
    return report


def render(report: dict[str, Any]) -> str:
    cfg, ing = report["config"], report["ingest"]
    lines = [
        f"replica CPU per chat request: {cfg['conversations']} conversations x {cfg['turns']} turns per side, "
        f"serial, {cfg['nodes']} nodes each; code {report['code']}, load average "
        f"{report['machine']['loadavg_start']} -> {report['machine']['loadavg_end']}",
        f"{'turn':>6} {'tokens':>7} | {'events on p50':>13} {'p90':>7} | {'events off p50':>14} {'p90':>7} (us)",
    ]
    on, off = report["events_on"], report["events_off"]
    rows = [
        (str(t), str(on["per_turn"][t]["prompt_tokens"]), on["per_turn"][t], off["per_turn"][t]) for t in on["per_turn"]
    ]
    rows += [("all", "", on["request"], off["request"]), ("betw.", "", on["between"], off["between"])]
    for turn, count, a, b in rows:
        lines.append(f"{turn:>6} {count:>7} | {a['p50_us']:>13} {a['p90_us']:>7} | {b['p50_us']:>14} {b['p90_us']:>7}")
    lines += [
        f"events on / off, p50: {report['ratio_p50']}x (+{report['added_p50_us']} us); "
        f"{on['events_per_request']} events a request; events-on counters {on['counters']}",
        f"requests per node (warm-up too): events on {on['node_requests']}, off {off['node_requests']}; prefix "
        f"cache hit rate {on['hit_rate']} / {off['hit_rate']}",
        f"ingest: {ing['events']} events ({ing['batches']} batches, {ing['blocks_stored']} blocks stored) "
        f"in {ing['seconds']} s, replica CPU {ing['replica_cpu_ms']} ms (idle {ing['idle_cpu_ms_per_s']} "
        f"ms/s; events off {ing['idle_cpu_ms_per_s_events_off']}): {ing['ms_per_1000_events']} ms per "
        f"1,000 events, {ing['ms_per_1000_batches']} per 1,000 batches, {ing['ms_per_1000_blocks_stored']} per "
        "1,000 blocks stored",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return report_and_exit_status(lambda: run(args), render, as_json=args.json, save=args.save)


if __name__ == "__main__":
    sys.exit(main())
