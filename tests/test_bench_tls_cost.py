"""``python -m bench.tls_cost --quick --json`` runs end to end: every scenario reports both replicas with all
requests answered (the TLS one over https with the run's CA). No timing assertions."""

from __future__ import annotations

import shutil

from tests.support.bench import run_bench


def test_quick_tls_bench_reports_plain_and_tls_for_every_scenario() -> None:
    assert shutil.which("openssl"), "the bench makes its certificate with openssl (.ci/run installs it)"
    report = run_bench(
        "bench.tls_cost", "--quick", "--requests", "60", "--stream-requests", "20", "--fresh-requests", "30"
    )
    assert report["ok"]
    assert [s["key"] for s in report["scenarios"]] == ["kept", "stream", "fresh"]
    for scenario in report["scenarios"]:
        for side in ("plain", "tls"):
            assert scenario[side]["failed"] == 0 and scenario[side]["ok"] > 0
        assert scenario["cpu_ratio"] >= 0
