"""Figures of bench.chat_sessions: per-phase measurements -> a JSON-ready summary -> the printed table.

No I/O besides formatting. Times are milliseconds in the summary, seconds in ``Phase``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.sessions import Run

SIDES = ("direct", "proxy")
DISTURBED_CORES = 0.3
"""Other processes' CPU during a phase, in cores, beyond which its figures are marked as disturbed."""


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One measured batch of sessions against one side, with the CPU the processes spent meanwhile."""

    side: str
    """direct or proxy."""
    round: int
    run: Run
    proxy_cpu: float
    """CPU seconds of the proxy (it also runs idle during direct phases: its health probes)."""
    node_cpu: float
    machine_busy: float
    machine_total: float
    """CPU seconds of the whole machine, busy and in all (from /proc/stat)."""


def percentiles_ms(samples: Sequence[float], cuts: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    """``p50``, ``p90``... and ``mean`` in ms (inclusive quantiles, as bench/report.py); None without samples."""
    if not samples:
        return {**{f"p{c}": None for c in cuts}, "mean": None}
    if len(samples) == 1:
        return {**{f"p{c}": samples[0] * 1000 for c in cuts}, "mean": samples[0] * 1000}
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return {**{f"p{c}": q[c - 1] * 1000 for c in cuts}, "mean": statistics.fmean(samples) * 1000}


def _side(phases: Sequence[Phase]) -> dict[str, Any]:
    """One side's phases pooled: every request of every round counts once."""
    turns = [t for p in phases for t in p.run.turns]
    ok = [t for t in turns if t.ok]
    wall = sum(p.run.wall for p in phases) or 1e-9
    n = len(ok) or 1
    sessions = sum(p.run.workload.sessions for p in phases)
    complete = sum(
        sum(1 for count in p.run.turns_per_session().values() if count == p.run.workload.turns) for p in phases
    )
    errors: dict[str, int] = {}
    nodes: dict[str, int] = {}
    for p in phases:
        for text, count in p.run.errors().items():
            errors[text] = errors.get(text, 0) + count
        for node, count in p.run.by_node().items():
            nodes[node] = nodes.get(node, 0) + count
    cpu = {
        "generator": sum(p.run.generator_cpu for p in phases),
        "nodes": sum(p.node_cpu for p in phases),
        "proxy": sum(p.proxy_cpu for p in phases),
    }
    busy = sum(p.machine_busy for p in phases)
    total = sum(p.machine_total for p in phases)
    lag = [s for p in phases for s in p.run.loop_lag]
    return {
        "requests": len(turns),
        "ok": len(ok),
        "failed": len(turns) - len(ok),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "sessions": sessions,
        "sessions_complete": complete,
        "tokens": sum(t.tokens for t in ok),
        "ttft_ms": percentiles_ms([t.ttft for t in ok if t.ttft is not None]),
        "latency_ms": percentiles_ms([t.latency for t in ok if t.latency is not None]),
        "requests_by_node": dict(sorted(nodes.items())),
        "wall_s": wall,
        "cpu_s": cpu | {"others": max(0.0, busy - sum(cpu.values()))},
        "cpu_ms_per_request": {k: v / n * 1000 for k, v in cpu.items()},
        "cores": {k: v / wall for k, v in cpu.items()} | {"others": max(0.0, busy - sum(cpu.values())) / wall},
        "machine_busy": busy / total if total else None,
        "loop_lag_ms": percentiles_ms(lag, (50, 99)) | {"max": max(lag) * 1000 if lag else None},
    }


def _others_cores(phase: Phase) -> float:
    ours = phase.run.generator_cpu + phase.node_cpu + phase.proxy_cpu
    return max(0.0, phase.machine_busy - ours) / phase.run.wall


def _added(phases: Sequence[Phase]) -> dict[str, Any]:
    """TTFT proxy - direct per round (each round is one direct and one proxy phase, in either order), and the
    median over rounds: a pair sees the same machine load on both sides, so drift cancels within it."""
    pairs: list[dict[str, Any]] = []
    for round_no in sorted({p.round for p in phases}):
        by_side = {p.side: p for p in phases if p.round == round_no}
        ttft = {side: percentiles_ms([t.ttft for t in by_side[side].run.ok if t.ttft is not None]) for side in SIDES}
        diff: dict[str, float | None] = {}
        for key in ("p50", "p99"):
            d, p = ttft["direct"][key], ttft["proxy"][key]
            diff[key] = p - d if d is not None and p is not None else None
        first = next(p.side for p in phases if p.round == round_no)
        others = {side: _others_cores(by_side[side]) for side in SIDES}
        pairs.append(
            {
                "round": round_no + 1,
                "first": first,
                **diff,
                "others_cores": others,
                "disturbed": max(others.values()) > DISTURBED_CORES,
            }
        )
    median: dict[str, float | None] = {}
    for key in ("p50", "p99"):
        values: list[float] = [pair[key] for pair in pairs if pair[key] is not None]
        median[key] = statistics.median(values) if values else None
    return {"pairs": pairs, "median": median}


def summarise(phases: Sequence[Phase]) -> dict[str, Any]:
    sides = {side: _side([p for p in phases if p.side == side]) for side in SIDES}
    added = _added(phases)
    # Also from all rounds pooled: a p99 per phase rests on a handful of requests, pooled on a few more.
    d, p = sides["direct"]["ttft_ms"], sides["proxy"]["ttft_ms"]
    added["pooled"] = {k: p[k] - d[k] if p[k] is not None and d[k] is not None else None for k in ("p50", "p99")}
    return {
        **sides,
        "added_ttft_ms": added,
        "proxy_cpu_ms_per_request": sides["proxy"]["cpu_ms_per_request"]["proxy"],
        "ok": all(sides[s]["failed"] == 0 and sides[s]["ok"] > 0 for s in SIDES),
    }


def _f(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def render(report: Mapping[str, Any]) -> str:
    """The human-readable table."""
    c, m, s = report["config"], report["machine"], report["summary"]
    pin = report["placement"]
    lines = [
        f"chat sessions: {c['nodes']} vllm-sim mixed nodes (ttft {c['ttft']:g} s, itl {c['itl']:g} s, "
        f"{c['max_tokens']} tokens per answer) direct vs through one vllm-proxy replica; code {report['code']}",
        f"workload: {c['sessions']} sessions x {c['turns']} turns, {c['concurrency']} at a time; system preamble "
        f"{c['system_words']} words (shared), first message {c['first_words']}, later ones {c['followup_words']}; "
        f"sessions start over {c['ramp']:g} s; {c['rounds']} round(s), direct and proxy alternating (ABBA)",
        "direct: each session pinned to node (session id % nodes); proxy: every request through the replica "
        "(its default policy)",
        f"placement: {pin['text']}",
        f"machine: {m['cpus']} CPUs, loopback, Python {m['python']}, {m['date']}; "
        f"load average {m['loadavg_start']} at start, {m['loadavg_end']} at end",
        "",
        f"{'':<7}{'requests':>9}{'failed':>7} |{'TTFT ms: p50':>13}{'p90':>7}{'p99':>7}{'mean':>7} |"
        f"{'latency p50':>12}{'p99':>7} |{'CPU ms/req: gen':>16}{'nodes':>7}{'proxy':>7} |"
        f"{'cores: gen':>11}{'nodes':>7}{'proxy':>7}{'others':>7} |{'gen lag p99':>12}",
    ]
    for side in SIDES:
        x = s[side]
        t, lat, per, cores = x["ttft_ms"], x["latency_ms"], x["cpu_ms_per_request"], x["cores"]
        lines.append(
            f"{side:<7}{x['requests']:>9}{x['failed']:>7} |{_f(t['p50']):>13}{_f(t['p90']):>7}{_f(t['p99']):>7}"
            f"{_f(t['mean']):>7} |{_f(lat['p50']):>12}{_f(lat['p99']):>7} |{per['generator']:>16.2f}"
            f"{per['nodes']:>7.2f}{per['proxy']:>7.2f} |{cores['generator']:>11.2f}{cores['nodes']:>7.2f}"
            f"{cores['proxy']:>7.2f}{cores['others']:>7.2f} |{_f(x['loop_lag_ms']['p99'], '.1f'):>12}"
        )
    added = s["added_ttft_ms"]
    lines += ["", f"{'added TTFT (proxy - direct), ms':<36}{'p50':>8}{'p99':>8}   others' cores (direct, proxy)"]
    for pair in added["pairs"]:
        label = f"round {pair['round']} ({pair['first']} first)"
        others = pair["others_cores"]
        mark = "  DISTURBED: rerun before comparing" if pair["disturbed"] else ""
        lines.append(
            f"{label:<36}{_f(pair['p50'], '+.2f'):>8}{_f(pair['p99'], '+.2f'):>8}"
            f"   {others['direct']:.2f}, {others['proxy']:.2f}{mark}"
        )
    med = added["median"]
    lines.append(f"{'median over rounds':<36}{_f(med['p50'], '+.2f'):>8}{_f(med['p99'], '+.2f'):>8}")
    pooled = added["pooled"]
    lines.append(f"{'all rounds pooled':<36}{_f(pooled['p50'], '+.2f'):>8}{_f(pooled['p99'], '+.2f'):>8}")
    lines.append("")
    for side in SIDES:
        x = s[side]
        spread = " ".join(str(v) for v in x["requests_by_node"].values())
        lines.append(
            f"{side}: {x['sessions_complete']}/{x['sessions']} sessions completed all turns; requests per node {spread}"
        )
    lines.append(
        f"proxy CPU: {_f(s['proxy_cpu_ms_per_request'], '.2f')} ms per request ({c['max_tokens']} streamed tokens each)"
    )
    failed = [side for side in SIDES if s[side]["failed"]]
    lines.append(
        "all requests succeeded"
        if not failed
        else "FAILED requests: " + "; ".join(f"{side}: {s[side]['errors']}" for side in failed)
    )
    return "\n".join(lines)
