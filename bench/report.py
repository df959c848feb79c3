"""Figures from the measured phases: a JSON-ready summary and the printed table. No I/O besides formatting."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.load import Result


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One kind of load, sent once direct and once through the proxy per round."""

    key: str
    title: str
    topology: str
    """mixed (one node) or disagg (a prefill and a decode node; direct means the client runs both legs)."""
    stream: bool
    tokens: int
    requests: int
    concurrency: int


@dataclass(kw_only=True)
class Totals:
    """One scenario against one target (direct or proxy), summed over rounds."""

    result: Result = field(default_factory=Result)
    wall: float = 0.0
    proxy_cpu: float = 0.0
    node_cpu: float = 0.0
    other_cpu: float = 0.0
    """CPU seconds used on the machine by processes outside this benchmark (other users' jobs)."""
    machine_busy: float = 0.0
    machine_total: float = 0.0
    relayed_chunks: int = 0
    """Body chunks the proxy wrote to clients (its vllm_proxy_stream_chunks counter)."""

    def add(
        self,
        result: Result,
        *,
        proxy_cpu: float,
        node_cpu: float,
        other_cpu: float,
        busy: float,
        total: float,
        relayed: int,
    ) -> None:
        self.result.merge(result)
        self.wall += result.wall
        self.proxy_cpu += proxy_cpu
        self.node_cpu += node_cpu
        self.other_cpu += other_cpu
        self.machine_busy += busy
        self.machine_total += total
        self.relayed_chunks += relayed


def percentiles_ms(samples: Sequence[float]) -> dict[str, float | None]:
    if len(samples) < 2:
        value = samples[0] * 1000 if samples else None
        return {"p50": value, "p99": value}
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50": cuts[49] * 1000, "p99": cuts[98] * 1000}


def _per_1000(cpu: float, count: int) -> float | None:
    return cpu / count * 1000 if count else None


def _side(t: Totals) -> dict[str, Any]:
    r = t.result
    wall = t.wall or 1e-9
    cpu = {"generator": r.generator_cpu, "nodes": t.node_cpu, "proxy": t.proxy_cpu, "others": t.other_cpu}
    return {
        "ok": r.ok,
        "failed": r.failed,
        "errors": dict(Counter(r.errors).most_common(5)),
        "wall_s": t.wall,
        "throughput_rps": r.ok / wall,
        "events_per_s": r.events / wall if r.events else None,
        "latency_ms": percentiles_ms(r.latencies),
        "ttft_ms": percentiles_ms(r.ttfts) if r.ttfts else None,
        "events": r.events,
        "relayed_chunks": t.relayed_chunks or None,
        "cpu_s": cpu,
        "cores": {name: seconds / wall for name, seconds in cpu.items()},
        "generator_cores": r.generator_cpu / wall,
        "machine_busy": t.machine_busy / t.machine_total if t.machine_total else None,
        "node_cpu_s_per_1000_requests": _per_1000(t.node_cpu, r.ok),
        "generator_cpu_s_per_1000_requests": _per_1000(r.generator_cpu, r.ok),
    }


def _added(direct: Mapping[str, float | None] | None, proxy: Mapping[str, float | None] | None) -> dict[str, Any]:
    """proxy - direct, per percentile; None where either side has no successful sample."""
    added: dict[str, float | None] = {}
    for k in ("p50", "p99"):
        d, p = (direct or {}).get(k), (proxy or {}).get(k)
        added[k] = p - d if d is not None and p is not None else None
    return added


def scenario_summary(scenario: Scenario, direct: Totals, proxy: Totals) -> dict[str, Any]:
    d, p = _side(direct), _side(proxy)
    key = "ttft_ms" if scenario.stream else "latency_ms"
    ok = proxy.result.ok
    summary: dict[str, Any] = {
        "key": scenario.key,
        "title": scenario.title,
        "topology": scenario.topology,
        "stream": scenario.stream,
        "tokens": scenario.tokens,
        "requests": scenario.requests,
        "concurrency": scenario.concurrency,
        "direct": d,
        "proxy": p,
        "throughput_ratio": p["throughput_rps"] / d["throughput_rps"] if d["throughput_rps"] else None,
        "added_ms": _added(d[key], p[key]),
        "added_ms_of": "ttft" if scenario.stream else "latency",
        "proxy_cpu_s_per_1000_requests": _per_1000(proxy.proxy_cpu, ok),
        "proxy_cpu_s_per_1000_chunks": _per_1000(proxy.proxy_cpu, proxy.result.events),
    }
    return summary


def all_succeeded(scenarios: Sequence[Mapping[str, Any]]) -> bool:
    return all(s[side]["failed"] == 0 and s[side]["ok"] > 0 for s in scenarios for side in ("direct", "proxy"))


def headline(scenarios: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The proxy's CPU cost per request and per streamed chunk, from the mixed scenarios.

    ``proxy_cpu_s_per_1000_chunks_marginal`` subtracts what the streams' requests cost at the non-streamed rate:
    an estimate of the per-chunk relay cost alone.
    """
    by_key = {s["key"]: s for s in scenarios}
    plain, stream = by_key.get("plain"), by_key.get("stream")
    per_request = plain["proxy_cpu_s_per_1000_requests"] if plain else None
    per_chunk = stream["proxy_cpu_s_per_1000_chunks"] if stream else None
    marginal = None
    if stream and per_request is not None and stream["proxy"]["events"]:
        p = stream["proxy"]
        marginal = (p["cpu_s"]["proxy"] - per_request * p["ok"] / 1000) / p["events"] * 1000
    return {
        "proxy_cpu_s_per_1000_requests": per_request,
        "proxy_cpu_s_per_1000_chunks": per_chunk,
        "proxy_cpu_s_per_1000_chunks_marginal": marginal,
    }


def _f(value: float | None, spec: str = ".1f", sign: bool = False) -> str:
    if value is None:
        return "-"
    return format(value, ("+" if sign else "") + spec)


def _pair(values: Mapping[str, float | None] | None, sign: bool = False) -> str:
    values = values or {}
    return f"{_f(values.get('p50'), sign=sign)} / {_f(values.get('p99'), sign=sign)}"


def _latency_rows(report: Mapping[str, Any]) -> list[str]:
    rows = [
        f"{'scenario':<26}{'requests':>8}{'conc':>5} |{'req/s direct':>13}{'proxy':>8}{'ratio':>7} |"
        f"{'(p50 / p99, ms)':>22}{'direct':>15}{'proxy':>17}{'added':>17}"
    ]
    for s in report["scenarios"]:
        d, p = s["direct"], s["proxy"]
        key = "ttft_ms" if s["stream"] else "latency_ms"
        rows.append(
            f"{s['title']:<26}{s['requests'] * report['config']['rounds']:>8}{s['concurrency']:>5} |"
            f"{d['throughput_rps']:>13.1f}{p['throughput_rps']:>8.1f}{_f(s['throughput_ratio'], '.2f') + 'x':>7} |"
            f"{'time to first token' if s['stream'] else 'latency':>22}{_pair(d[key]):>15}{_pair(p[key]):>17}"
            f"{_pair(s['added_ms'], sign=True):>17}"
        )
    return rows


def _cpu_rows(report: Mapping[str, Any]) -> list[str]:
    rows = [
        f"{'CPU':<26}{'':<8}{'ms per request':>28} |{'cores busy (CPU s / wall s)':>37} |{'machine':>9}",
        f"{'scenario':<26}{'target':<8}{'generator':>10}{'node(s)':>9}{'proxy':>9} |"
        f"{'generator':>10}{'node(s)':>9}{'proxy':>8}{'others':>10} |{'busy':>9}",
    ]
    for s in report["scenarios"]:
        for side in ("direct", "proxy"):
            x = s[side]
            cpu, ok, wall = x["cpu_s"], x["ok"] or 1, x["wall_s"] or 1e-9
            rows.append(
                f"{(s['title'] if side == 'direct' else ''):<26}{side:<8}"
                f"{cpu['generator'] / ok * 1000:>10.2f}{cpu['nodes'] / ok * 1000:>9.2f}"
                f"{(_f(cpu['proxy'] / ok * 1000, '.2f') if side == 'proxy' else '-'):>9} |"
                f"{cpu['generator'] / wall:>10.2f}{cpu['nodes'] / wall:>9.2f}"
                f"{(_f(cpu['proxy'] / wall, '.2f') if side == 'proxy' else '-'):>8}{cpu['others'] / wall:>10.2f} |"
                f"{_f(x['machine_busy'] and x['machine_busy'] * 100, '.0f') + '%':>9}"
            )
    return rows


def render(report: Mapping[str, Any]) -> str:
    """The human-readable tables."""
    m, c, h = report["machine"], report["config"], report["headline"]
    lines = [
        f"vllm-sim (ttft 0, itl {c['itl']:g} s) direct vs through vllm-proxy: {c['rounds']} round(s), direct and proxy "
        f"alternating (ABBA); "
        f"{c['processes']} load generator process(es), httpx clients {c['clients']}; code {report['code']}",
        f"machine: {m['cpus']} CPUs, loopback, Python {m['python']}, {m['date']}; "
        f"load average {m['loadavg_start']} at start, {m['loadavg_end']} at end",
        "",
        *_latency_rows(report),
        "",
        *_cpu_rows(report),
        "",
        f"proxy CPU: {_f(h['proxy_cpu_s_per_1000_requests'], '.2f')} s per 1,000 non-streamed requests; "
        f"{_f(h['proxy_cpu_s_per_1000_chunks'], '.3f')} s per 1,000 streamed chunks (SSE events), "
        f"{_f(h['proxy_cpu_s_per_1000_chunks_marginal'], '.3f')} s of which beyond the per-request cost",
    ]
    for s in report["scenarios"]:
        for side in ("direct", "proxy"):
            if s[side]["failed"]:
                lines.append(f"FAILED {s['title']} {side}: {s[side]['failed']} request(s): {s[side]['errors']}")
    lines.append("all requests succeeded" if report["ok"] else "SOME REQUESTS FAILED")
    return "\n".join(lines)
