"""``python -m bench.routing --quick --json`` runs end to end: every request succeeds in every scenario, each
row has its figures (hit rate, balance, stickiness, TTFT; new sessions by third with a slow node; prefill legs in
the P/D fleet), and every server it started is gone afterwards. No assertions on the figures' values: they are
what the benchmark is for, and the machine may be busy."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.bench import run_bench, still_running


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run_bench("bench.routing", "--quick", timeout=120)


def _rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for scenario in report["scenarios"] for row in scenario["rows"]]


def test_quick_routing_bench_runs_every_scenario_and_every_request_succeeds(report: dict[str, Any]) -> None:
    assert report["ok"] is True
    assert [s["name"] for s in report["scenarios"]] == ["chat-short", "completions", "slow-node", "pd"]
    config = report["config"]
    for row in _rows(report):
        name = f"{row['scenario']}/{row['router']}"
        assert row["failed"] == 0, (name, row["errors"])
        assert row["requests"] == row["ok"] == config["sessions"] * config["turns"], name
        assert row["sessions_complete"] == config["sessions"], name


def test_quick_routing_bench_reports_hit_rate_balance_stickiness_and_ttft(report: dict[str, Any]) -> None:
    for row in _rows(report):
        name = f"{row['scenario']}/{row['router']}"
        assert 0 < row["hit_rate"] <= 1, name
        assert row["max_mean"] >= 1, name
        assert 0 <= row["same_node_share"] <= 1, name
        assert row["ttft_ms"]["p99"] >= row["ttft_ms"]["p50"] > 0, name
        assert "?" not in row["requests_by_node"], f"{name}: a response without the x-sim-node header"
        assert sum(row["requests_by_node"].values()) == row["ok"], name
        assert sum(row["moved_turns"].values()) <= row["ok"], name
    chat = report["scenarios"][0]
    assert {row["kind"] for row in chat["rows"]} >= {"oracle", "proxy"}
    for verdict in chat["targets"]["rows"].values():
        assert verdict["hit_rate_vs_oracle"] is not None and verdict["ttft_p50_vs_oracle"] is not None


def test_quick_routing_bench_reports_new_sessions_per_node_with_a_slow_node(report: dict[str, Any]) -> None:
    slow = next(s for s in report["scenarios"] if s["name"] == "slow-node")
    for row in slow["rows"]:
        assert row["slow_node"] in row["sessions_by_node"]
        thirds = row["new_sessions_by_third"]
        assert len(thirds) == 3 and all(set(third["shares"]) == set(row["sessions_by_node"]) for third in thirds)
        assert thirds[0]["from_s"] <= thirds[-1]["to_s"]
        assert set(row["load_by_node"]) == set(row["sessions_by_node"])
        # Compared with the same router on the all-healthy workload (chat-short in the same run).
        assert slow["targets"]["rows"][f"{row['router']} R={row['replicas']}"]["slow_ttft_p99_vs_healthy"] > 0


def test_quick_routing_bench_traces_each_prefill_leg_to_its_session(report: dict[str, Any]) -> None:
    pd = next(s for s in report["scenarios"] if s["name"] == "pd")
    for row in pd["rows"]:
        legs = row["pd"]
        assert legs["prefill_legs"] + legs["turns_without_prefill"] == row["ok"]
        assert legs["sessions_on_one_prefill_node"] <= legs["sessions_with_2plus_legs"] <= report["config"]["sessions"]
        assert set(row["requests_by_node"]) == {"decode0", "decode1"}


def test_quick_routing_bench_stops_every_server_it_started(report: dict[str, Any]) -> None:
    pids = report["server_pids"]
    assert any(name.endswith("/mixed0") for name in pids) and any(name.endswith("/proxy0") for name in pids)
    assert still_running(pids) == []
