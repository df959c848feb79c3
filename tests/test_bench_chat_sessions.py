"""``python -m bench.chat_sessions --quick --json`` runs end to end: every request succeeds, every session runs all
its turns on both sides, the figures are there, and every server it started is gone afterwards. No timing
assertions: the machine may be busy."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.bench import run_bench, still_running

SIDES = ("direct", "proxy")


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run_bench("bench.chat_sessions", "--quick", timeout=90)


def test_quick_chat_bench_every_request_succeeds_and_every_session_runs_all_turns(report: dict[str, Any]) -> None:
    config, summary = report["config"], report["summary"]
    assert report["ok"] is True
    sessions = config["sessions"] * config["rounds"]
    for side in SIDES:
        x = summary[side]
        assert x["failed"] == 0, (side, x["errors"])
        assert x["requests"] == x["ok"] == sessions * config["turns"], side
        assert x["sessions"] == x["sessions_complete"] == sessions, side
        assert x["tokens"] == x["ok"] * config["max_tokens"], side


def test_quick_chat_bench_names_every_answers_node_and_spreads_sessions_on_both_sides(report: dict[str, Any]) -> None:
    summary, nodes = report["summary"], report["config"]["nodes"]
    for side in SIDES:
        assert "?" not in summary[side]["requests_by_node"], "a response without the x-sim-node header"
    assert len(summary["direct"]["requests_by_node"]) == nodes  # pinned: session % nodes
    # Through the proxy, cache-aware places each conversation by its hash: 16 of them leave one of 4 nodes
    # without any in about 4% of runs, but all on one node only in about one run in 10^9.
    assert len(summary["proxy"]["requests_by_node"]) >= 2, summary["proxy"]["requests_by_node"]


def test_quick_chat_bench_reports_ttft_latency_cpu_and_added_ttft(report: dict[str, Any]) -> None:
    summary = report["summary"]
    for side in SIDES:
        x = summary[side]
        for key in ("p50", "p90", "p99", "mean"):
            assert x["ttft_ms"][key] > 0, (side, key)
        assert x["latency_ms"]["p99"] >= x["latency_ms"]["p50"] >= x["ttft_ms"]["p50"]
        assert x["cpu_ms_per_request"]["generator"] > 0
        assert x["loop_lag_ms"]["p99"] is not None
    assert summary["proxy_cpu_ms_per_request"] > 0
    added = summary["added_ttft_ms"]
    assert len(added["pairs"]) == report["config"]["rounds"]
    for key in ("median", "pooled"):
        assert added[key]["p50"] is not None and added[key]["p99"] is not None, key


def test_quick_chat_bench_stops_every_server_it_started(report: dict[str, Any]) -> None:
    pids = report["server_pids"]
    assert set(pids) == {"proxy", *(f"node{i}" for i in range(report["config"]["nodes"]))}
    assert still_running(pids) == []
