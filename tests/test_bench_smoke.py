"""``python -m bench.proxy_overhead --quick --json`` runs end to end: figures present and sane, no request
failed, every server it started is gone afterwards. No timing assertions: the machine may be busy."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.bench import run_bench, still_running

SCENARIOS = {"plain", "stream", "serial", "disagg-plain", "disagg-stream"}


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run_bench("bench.proxy_overhead", "--quick", timeout=120)


def test_quick_bench_reports_every_scenario_with_all_requests_succeeded(report: dict[str, Any]) -> None:
    assert report["ok"] is True
    assert {s["key"] for s in report["scenarios"]} == SCENARIOS
    for s in report["scenarios"]:
        for side in ("direct", "proxy"):
            x = s[side]
            assert x["failed"] == 0, (s["key"], side, x["errors"])
            assert x["ok"] == s["requests"] * report["config"]["rounds"], (s["key"], side)
            assert x["throughput_rps"] > 0
            assert x["latency_ms"]["p50"] > 0 and x["latency_ms"]["p99"] >= x["latency_ms"]["p50"]
            if s["stream"]:
                assert x["events"] == x["ok"] * s["tokens"]
                assert x["ttft_ms"]["p50"] > 0
        assert s["throughput_ratio"] > 0
        assert s["added_ms"]["p50"] is not None and s["added_ms"]["p99"] is not None
        if s["stream"]:
            assert s["proxy"]["relayed_chunks"] > 0


def test_quick_bench_headline_has_the_proxy_cpu_figures(report: dict[str, Any]) -> None:
    headline = report["headline"]
    assert headline["proxy_cpu_s_per_1000_requests"] > 0
    assert headline["proxy_cpu_s_per_1000_chunks"] > 0
    assert report["machine"]["cpus"] >= 1


def test_quick_bench_stops_every_server_it_started(report: dict[str, Any]) -> None:
    pids = report["server_pids"]
    assert set(pids) == {"node", "proxy", "prefill", "decode", "proxy-disagg"}
    assert still_running(pids) == []
