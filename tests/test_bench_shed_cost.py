"""``python -m bench.shed_cost`` runs end to end on a short load: both refusals measured, every request refused.
No timing assertions: the machine may be busy."""

from __future__ import annotations

from tests.support.bench import run_bench


def test_the_shed_cost_bench_measures_both_refusals() -> None:
    report = run_bench("bench.shed_cost", "--requests", "20", "--rounds", "1", "--kib", "16", timeout=120)
    assert report["ok"] is True and report["failed"] == 0
    cases = report["cpu_us_per_refused"]["this"]
    assert cases["limit"] > 0 and cases["tenant"] > 0
