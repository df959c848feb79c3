"""``python -m bench.kv_cost --quick --json`` runs end to end on real processes: both stacks report CPU per
request for every turn, the events-on replica tokenized and routed on its nodes' events while the events-off one
had none, the ingest counted events, and every server it started is gone afterwards. No timing assertions."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.bench import run_bench, still_running


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run_bench("bench.kv_cost", "--quick", timeout=90)


def test_quick_run_reports_cpu_per_request_for_every_turn_on_both_sides(report: dict[str, Any]) -> None:
    assert report["ok"] is True
    for side in ("events_on", "events_off"):
        figures = report[side]
        assert set(figures["per_turn"]) == {"1", "2", "3", "4", "5", "6"}
        assert figures["request"]["p50_us"] > 0
        assert figures["request"]["p90_us"] >= figures["request"]["p50_us"]
    assert report["events_on"]["per_turn"]["6"]["prompt_tokens"] > 1500
    assert report["ratio_p50"] > 0


def test_only_the_events_on_replica_took_in_events_and_tokenized(report: dict[str, Any]) -> None:
    on, off = report["events_on"]["counters"], report["events_off"]["counters"]
    assert on["events"] > 0 and on.get("tokenize incremental", 0) > 0
    assert on.get("decision fallback", 0) == 0
    assert "events" not in off and off.get("tokenize incremental", 0) == 0


def test_ingest_counts_the_events_the_replica_took_in(report: dict[str, Any]) -> None:
    ingest = report["ingest"]
    assert ingest["events"] >= ingest["requests"]  # a store per request at least, perhaps removals
    assert ingest["ms_per_1000_events"] is not None and ingest["blocks_stored"] > 0


def test_quick_run_stops_every_server_it_started(report: dict[str, Any]) -> None:
    assert len(report["server_pids"]) == 2 + 2 * report["config"]["nodes"]
    assert still_running(report["server_pids"]) == []
