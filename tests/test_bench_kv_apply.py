"""``python -m bench.kv_apply`` runs end to end on a small fleet: it times the steady state (every node full, a
store and a removal a batch) and reports both halves. No timing assertions."""

from __future__ import annotations

import json

import pytest

from bench.kv_apply import main


def test_small_run_reports_decode_and_apply(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nodes", "3", "--batches", "300", "--warm", "260", "--repeat", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["batches_timed"] == 3 * 40
    assert report["decode_us"] > 0 and report["apply_us"] > 0
    assert report["total_us"] == pytest.approx(report["decode_us"] + report["apply_us"], abs=0.2)


def test_warm_must_leave_batches_to_time() -> None:
    with pytest.raises(SystemExit):
        main(["--batches", "10", "--warm", "10"])
