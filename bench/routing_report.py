"""Figures of bench.routing: one routed run (the client's records and what the nodes recorded) -> a JSON-ready
summary; a scenario's summaries -> the issue's targets; everything -> the printed tables. No I/O.

Times are milliseconds in the summaries, seconds in ``Outcome``.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.chat_report import percentiles_ms
from bench.routing_fleet import LoadSample, NodeReport
from bench.sessions import Run, parse_request_id

THIRDS = 3
KV_FULL = 0.95
OVERLOAD = (1.5, 2)
"""cache-aware's escape (proxy/balancer.py): a node's load above 1.5 x the mean + 2, or its KV cache >= 95%."""
TARGETS = {"hit_rate_vs_oracle": 0.97, "max_mean": 1.10, "ttft_p50_vs_oracle": 1.10, "slow_ttft_p99_vs_healthy": 1.5}


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One router's run of one scenario's workload."""

    scenario: str
    router: str
    """The row's name, e.g. "cache-aware" or "vllm-router sticky_least_loaded + X-Session-ID"."""
    kind: str
    """oracle, direct (sprayed over the nodes), proxy or vllm-router."""
    replicas: int
    tag: str
    """The run's request-id tag (bench.sessions.request_id)."""
    run: Run
    nodes: Sequence[NodeReport]
    cpu: Mapping[str, float]
    """CPU seconds of the nodes and of the frontend replicas during the run."""
    load: Sequence[LoadSample] = ()
    """The nodes' own load during the run, sampled by the load generator."""
    slow_node: str | None = None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _at_least(value: float | None, limit: float) -> bool | None:
    """None when there is nothing to compare with (no oracle or no vllm-router row in the scenario)."""
    return None if value is None else value >= limit


def _at_most(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def _hit_rate(nodes: Sequence[NodeReport]) -> float | None:
    queries = sum(n.queries for n in nodes)
    return sum(n.hits for n in nodes) / queries if queries else None


def _new_session_shares(run: Run, names: Sequence[str]) -> list[dict[str, Any]]:
    """The sessions in thirds by when they started (first, middle, last third of them): for each third, when its
    sessions started (s into the run) and each node's share of them, by the node that answered turn 0."""
    firsts = sorted((t for t in run.turns if t.turn == 0 and t.ok), key=lambda t: t.sent)
    thirds = []
    for i in range(THIRDS):
        part = firsts[len(firsts) * i // THIRDS : len(firsts) * (i + 1) // THIRDS]
        counts = Counter(t.node or "?" for t in part)
        thirds.append(
            {
                "from_s": part[0].sent - run.started if part else None,
                "to_s": part[-1].sent - run.started if part else None,
                "shares": {n: counts[n] / max(1, len(part)) for n in names},
            }
        )
    return thirds


class _LoadAt:
    """The latest sample of each node at a given time."""

    def __init__(self, samples: Sequence[LoadSample]) -> None:
        self._by_node: dict[str, list[LoadSample]] = defaultdict(list)
        for sample in sorted(samples, key=lambda x: x.at):
            self._by_node[sample.node].append(sample)
        self._times = {n: [x.at for x in xs] for n, xs in self._by_node.items()}

    def at(self, when: float) -> dict[str, LoadSample]:
        found = {}
        for node, times in self._times.items():
            i = bisect.bisect_right(times, when)
            if i:
                found[node] = self._by_node[node][i - 1]
        return found


def _moves(outcome: Outcome, turns: Mapping[int, Mapping[int, Any]]) -> dict[str, int]:
    """Turns answered by another node than the turn before, by why they likely moved: the earlier node's KV cache
    was nearly full, or its load beyond cache-aware's escape, when the turn was sent (as sampled); else back to
    a node of an earlier turn (the way home after an escape); else none of these (the key changed, or the
    replicas judged the nodes differently)."""
    load = _LoadAt(outcome.load)
    moves: Counter[str] = Counter({"kv_full": 0, "overloaded": 0, "back": 0, "other": 0})
    for by_turn in turns.values():
        for i, t in sorted(by_turn.items()):
            before = by_turn.get(i - 1)
            if before is None or before.node == t.node:
                continue
            seen = load.at(t.sent)
            was = seen.get(before.node)
            mean = sum(x.running + x.waiting for x in seen.values()) / len(seen) if seen else 0.0
            if was is not None and was.kv_usage >= KV_FULL:
                moves["kv_full"] += 1
            elif was is not None and was.running + was.waiting > OVERLOAD[0] * mean + OVERLOAD[1]:
                moves["overloaded"] += 1
            elif any(by_turn[j].node == t.node for j in by_turn if j < i - 1):
                moves["back"] += 1
            else:
                moves["other"] += 1
    return dict(moves)


def _load_by_node(samples: Sequence[LoadSample], names: Sequence[str]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for name in names:
        mine = [x for x in samples if x.node == name]
        out[name] = {
            "mean_load": sum(x.running + x.waiting for x in mine) / len(mine) if mine else None,
            "max_load": max((x.running + x.waiting for x in mine), default=None),
            "max_kv_usage": max((x.kv_usage for x in mine), default=None),
            "kv_full_share": sum(x.kv_usage >= KV_FULL for x in mine) / len(mine) if mine else None,
        }
    return out


def _prefill_legs(outcome: Outcome) -> dict[str, Any]:
    """Which prefill node took each turn's prefill leg (a P/D fleet): per session, did they all go to one?"""
    where: dict[int, dict[int, str]] = defaultdict(dict)
    for node in outcome.nodes:
        if node.role != "prefill":
            continue
        for record in node.requests:
            parsed = parse_request_id(record.get("request_id") or "")
            if parsed and parsed[0] == outcome.tag and record.get("status") in (200, None):
                where[parsed[1]][parsed[2]] = node.name
    several = [s for s, legs in where.items() if len(legs) >= 2]
    one_node = [s for s in several if len(set(where[s].values())) == 1]
    legs = sum(len(v) for v in where.values())
    return {
        "prefill_legs": legs,
        "turns_without_prefill": len(outcome.run.ok) - legs,
        "sessions_with_2plus_legs": len(several),
        "sessions_on_one_prefill_node": len(one_node),
        "one_node_share": len(one_node) / len(several) if several else None,
        "hit_rate_prefill": _hit_rate([n for n in outcome.nodes if n.role == "prefill"]),
        "hit_rate_decode": _hit_rate([n for n in outcome.nodes if n.role == "decode"]),
    }


def summarise(outcome: Outcome) -> dict[str, Any]:
    run = outcome.run
    ok = run.ok
    answering = [n for n in outcome.nodes if n.role != "prefill"]
    names = [n.name for n in answering]
    by_node = Counter(t.node or "?" for t in ok)
    requests = {n: by_node.get(n, 0) for n in names} | ({"?": by_node["?"]} if by_node.get("?") else {})
    mean = len(ok) / len(names) if names else 0.0
    by_session: dict[int, dict[int, Any]] = defaultdict(dict)
    for t in ok:
        by_session[t.session][t.turn] = t
    pairs = [(turns[i - 1].node, turns[i].node) for turns in by_session.values() for i in turns if i and i - 1 in turns]
    sessions = Counter(t.node or "?" for t in ok if t.turn == 0)
    summary: dict[str, Any] = {
        "scenario": outcome.scenario,
        "router": outcome.router,
        "kind": outcome.kind,
        "replicas": outcome.replicas,
        "requests": len(run.turns),
        "ok": len(ok),
        "failed": len(run.failed),
        "errors": dict(run.errors().most_common(3)),
        "sessions_complete": sum(1 for n in run.turns_per_session().values() if n == run.workload.turns),
        "hit_rate": _hit_rate(answering if any(n.role == "mixed" for n in answering) else outcome.nodes),
        "cache_tokens": {n.name: {"queries": n.queries, "hits": n.hits} for n in outcome.nodes},
        "requests_by_node": requests,
        "max_mean": max(requests.values()) / mean if mean else None,
        "same_node_share": sum(a == b for a, b in pairs) / len(pairs) if pairs else None,
        "sessions_by_node": {n: sessions.get(n, 0) for n in names},
        "new_sessions_by_third": _new_session_shares(run, names),
        "moved_turns": _moves(outcome, by_session),
        "load_by_node": _load_by_node(outcome.load, [n.name for n in outcome.nodes]),
        "ttft_ms": percentiles_ms([t.ttft for t in ok if t.ttft is not None], (50, 90, 99)),
        "wall_s": run.wall,
        "cpu_s": dict(outcome.cpu),
        "generator_cpu_s": run.generator_cpu,
        "slow_node": outcome.slow_node,
    }
    if any(n.role == "prefill" for n in outcome.nodes):
        summary["pd"] = _prefill_legs(outcome)
    return summary


def judge(rows: Sequence[dict[str, Any]], healthy: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The issue's targets for this project's rows, against the oracle and vllm-router's best p99 in the same
    scenario; with ``healthy`` (the same routers without a slow node), TTFT p99 against that run."""
    oracle = next((r for r in rows if r["kind"] == "oracle"), None)
    oracle_hit = oracle["hit_rate"] if oracle else None
    oracle_p50 = oracle["ttft_ms"]["p50"] if oracle else None
    peers = [r["ttft_ms"]["p99"] for r in rows if r["kind"] == "vllm-router" and r["failed"] == 0]
    best_peer = min(peers) if peers else None
    before = {r["router"] + f"/{r['replicas']}": r for r in healthy}
    verdicts: dict[str, Any] = {"vllm_router_best_p99_ms": best_peer, "rows": {}}
    for r in rows:
        if r["kind"] != "proxy":
            continue
        v: dict[str, Any] = {
            "hit_rate_vs_oracle": _ratio(r["hit_rate"], oracle_hit),
            "max_mean": r["max_mean"],
            "ttft_p50_vs_oracle": _ratio(r["ttft_ms"]["p50"], oracle_p50),
            "ttft_p99_vs_vllm_router_best": _ratio(r["ttft_ms"]["p99"], best_peer),
        }
        base = before.get(r["router"] + f"/{r['replicas']}")
        if base is not None:
            v["slow_ttft_p99_vs_healthy"] = _ratio(r["ttft_ms"]["p99"], base["ttft_ms"]["p99"])
        v["met"] = {
            "hit_rate": _at_least(v["hit_rate_vs_oracle"], TARGETS["hit_rate_vs_oracle"]),
            "balance": _at_most(v["max_mean"], TARGETS["max_mean"]),
            "ttft_p50": _at_most(v["ttft_p50_vs_oracle"], TARGETS["ttft_p50_vs_oracle"]),
            "ttft_p99": _at_most(v["ttft_p99_vs_vllm_router_best"], 1.0),
        }
        if "slow_ttft_p99_vs_healthy" in v:
            v["met"]["slow_ttft_p99"] = _at_most(v["slow_ttft_p99_vs_healthy"], TARGETS["slow_ttft_p99_vs_healthy"])
        verdicts["rows"][f"{r['router']} R={r['replicas']}"] = v
    return verdicts


def _f(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _shares(values: Mapping[str, float]) -> str:
    return " ".join(f"{v:.2f}" for v in values.values())


def render_scenario(scenario: Mapping[str, Any]) -> str:
    rows, verdicts = scenario["rows"], scenario["targets"]
    lines = [f"## {scenario['name']}: {scenario['description']}", ""]
    head = (
        "| router | R | hit rate | max/mean requests per node | share of turns on the previous turn's node | "
        "TTFT p50 / p99 ms | failed | sessions per node | moved turns: KV full / overloaded / back / other "
        "|"
    )
    if any("pd" in r for r in rows):
        head = (
            "| router | R | hit rate prefill / decode | sessions whose prefill legs all went to one node | "
            "turns with no prefill leg | TTFT p50 / p99 ms | failed | requests per decode node |"
        )
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r["ttft_ms"]
        ttft = f"{_f(t['p50'])} / {_f(t['p99'])}"
        replicas = str(r["replicas"]) if r["kind"] in ("proxy", "vllm-router") else "-"
        if "pd" in r:
            pd = r["pd"]
            one = f"{pd['sessions_on_one_prefill_node']}/{pd['sessions_with_2plus_legs']}"
            spread = " ".join(str(v) for v in r["requests_by_node"].values())
            lines.append(
                f"| {r['router']} | {replicas} | {_f(pd['hit_rate_prefill'], '.3f')} / "
                f"{_f(pd['hit_rate_decode'], '.3f')} | {one} | {pd['turns_without_prefill']} | {ttft} | "
                f"{r['failed']} | {spread} |"
            )
            continue
        spread = " ".join(str(v) for v in r["sessions_by_node"].values())
        moved = " / ".join(str(v) for v in r["moved_turns"].values())
        lines.append(
            f"| {r['router']} | {replicas} | {_f(r['hit_rate'], '.3f')} | {_f(r['max_mean'], '.2f')} | "
            f"{_f(r['same_node_share'], '.2f')} | {ttft} | {r['failed']} | {spread} | {moved} |"
        )
    slow = [r for r in rows if r.get("slow_node")]
    if slow:
        lines += [
            "",
            f"share of new sessions per node ({', '.join(slow[0]['sessions_by_node'])}; slow: "
            f"{slow[0]['slow_node']}) in the first, middle and last third of the sessions to start; then the "
            "mean load (running + waiting) per node:",
        ]
        for r in slow:
            thirds = " | ".join(
                f"{_shares(third['shares'])} ({_f(third['from_s'])}-{_f(third['to_s'])} s)"
                for third in r["new_sessions_by_third"]
            )
            loads = " ".join(_f(x["mean_load"]) for x in r["load_by_node"].values())
            name = f"{r['router']} R={r['replicas']}" if r["kind"] in ("proxy", "vllm-router") else r["router"]
            lines.append(f"  {name}: {thirds}; load {loads}")
    comparable = any(r["kind"] == "oracle" for r in rows) or any(
        "slow_ttft_p99_vs_healthy" in v for v in verdicts["rows"].values()
    )  # a P/D fleet has neither an oracle nor a healthy twin
    if verdicts["rows"] and comparable:
        lines += [
            "",
            f"targets (this project's rows; vllm-router's best p99 here: "
            f"{_f(verdicts['vllm_router_best_p99_ms'])} ms):",
        ]
        for name, v in verdicts["rows"].items():
            missed = [k for k, ok in v["met"].items() if ok is False]
            unknown = [k for k, ok in v["met"].items() if ok is None]
            parts = [
                f"hit {_f(v['hit_rate_vs_oracle'], '.3f')}x oracle",
                f"max/mean {_f(v['max_mean'], '.2f')}",
                f"p50 {_f(v['ttft_p50_vs_oracle'], '.2f')}x oracle",
                f"p99 {_f(v['ttft_p99_vs_vllm_router_best'], '.2f')}x vllm-router best",
            ]
            if "slow_ttft_p99_vs_healthy" in v:
                parts.append(f"p99 {_f(v['slow_ttft_p99_vs_healthy'], '.2f')}x healthy")
            verdict = "all met" if not missed else "missed: " + ", ".join(missed)
            if unknown:
                verdict += f" (nothing to compare {', '.join(unknown)} with)"
            lines.append(f"  {name}: {'; '.join(parts)} -> {verdict}")
    return "\n".join(lines)


def render(report: Mapping[str, Any]) -> str:
    c, m = report["config"], report["machine"]
    lines = [
        f"routing quality: {c['nodes']} vllm-sim nodes per run, restarted for every router (caches cold); code "
        f"{report['code']}",
        f"nodes: ttft {c['ttft']:g} s + {c['prefill_per_token']:g} s per uncached prompt token, itl {c['itl']:g} s, "
        f"{c['max_tokens']} tokens per answer, prefix cache of blocks of {c['block_size']} tokens (size per scenario)"
        + (
            f"; each step {c['batch_slowdown']:g} x longer per other running sequence"
            if c.get("batch_slowdown")
            else ""
        ),
        f"workload: {c['sessions']} sessions x {c['turns']} turns, {c['concurrency']} at a time, think time "
        f"{c['think']:g}-{c['think'] + c['think_jitter']:g} s (seeded); proxies: --scrape-load "
        f"{c.get('scrape_load', 0.25):g}; requests alternate over a router's replicas",
        f"placement: {report['placement']['text']}",
        f"machine: {m['cpus']} CPUs, Python {m['python']}, {m['date']}; load average {m['loadavg_start']} at "
        f"start, {m['loadavg_end']} at end; {report['wall_s']:.0f} s in all",
    ]
    for scenario in report["scenarios"]:
        lines += ["", render_scenario(scenario)]
    failed = sum(r["failed"] for s in report["scenarios"] for r in s["rows"])
    lines += ["", "all requests succeeded" if not failed else f"FAILED requests: {failed}"]
    return "\n".join(lines)
