"""``python -m bench.tenants`` runs end to end on a short load: every run reported, no quiet request failed.
No timing assertions: the machine may be busy."""

from __future__ import annotations

from tests.support.bench import run_bench


def test_the_tenants_bench_reports_the_quiet_tenant_in_every_run() -> None:
    report = run_bench("bench.tenants", "--seconds", "2", "--quiet-rps", "2", timeout=180)
    assert report["ok"] is True
    assert set(report["runs"]) == {"solo", "queue-off", "queue-on"}
    for name, run in report["runs"].items():
        assert run["quiet"].get("ok", 0) > 0 and run["quiet_ttft_ms"]["p50"] > 0, name
    assert report["runs"]["solo"]["noisy"] == {} and report["runs"]["queue-on"]["noisy"].get("ok", 0) > 0
    assert set(report["vs_solo"]) == {"queue-off", "queue-on"}
