"""``python -m bench.supervisor_cost`` runs end to end: every figure reported, and the supervised command's death by
SIGTERM reaches the caller as 143, as a bare command's does (the bench exits 1 otherwise). No timing assertions."""

from __future__ import annotations

import signal

from tests.support.bench import run_bench


def test_small_run_reports_every_figure_and_passes_the_exit_code_on() -> None:
    report = run_bench("bench.supervisor_cost", "--runs", "2", "--idle", "0.2", timeout=60)
    assert report["ok"] is True
    assert report["sigterm_bare"]["exit_codes"] == [-signal.SIGTERM]  # Popen's way; a shell says 143
    assert report["sigterm_supervised"]["exit_codes"] == [128 + signal.SIGTERM]
    assert report["start_to_exit_ms"]["supervised"] > 0 and report["idle"]["rss_kb"] > 0
