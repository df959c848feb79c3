"""``python -m bench.tokenize_cost`` runs end to end on small conversations: both tokenizers report, the
incremental ids equal tokenizing whole (the bench exits non-zero otherwise). No timing assertions."""

from __future__ import annotations

import json

import pytest

from bench.tokenize_cost import main


def test_small_run_reports_both_tokenizers(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--conversations", "2", "--turns", "3", "--system-words", "40", "--user-words", "10", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"vllm-sim (WordPiece)", "ChatML byte-level BPE"}
    for row in report.values():
        assert row["last_turn_tokens"] > 40
        assert row["first_turn_us"] > 0 and row["later_turns_cached_us"] > 0
