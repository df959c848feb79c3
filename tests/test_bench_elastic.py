"""``python -m bench.elastic`` runs end to end on a short load: every layout and phase reported, no request failed,
and the both layout's decisions follow the traffic (long new prompts split, short ones run on one node). No
timing or goodput assertions: the machine may be busy."""

from __future__ import annotations

from tests.support.bench import run_bench


def test_the_elastic_bench_reports_each_layout_and_the_both_nodes_follow_the_traffic() -> None:
    report = run_bench("bench.elastic", "--quick", "--layouts", "pd,both", timeout=240)
    assert report["ok"] is True and report["failed_requests"] == 0
    layouts = {layout["layout"]: layout for layout in report["layouts"]}
    assert set(layouts) == {"pd", "both"}
    for layout in layouts.values():
        assert [p["phase"] for p in layout["phases"]] == ["prompt-heavy", "decode-heavy", "mixed"]
        assert all(p["requests"] > 0 and p["ok"] == p["requests"] for p in layout["phases"])
    work = {w["phase"]: w for w in layouts["both"]["work"]}
    assert set(work["prompt-heavy"]["decisions"]) == {"split/split"}
    assert set(work["decode-heavy"]["decisions"]) == {"local/few_new"}
    for node, legs in work["prompt-heavy"]["legs_by_node"].items():
        assert set(legs) <= {"prefill", "decode"}, node
