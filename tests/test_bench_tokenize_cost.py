"""``python -m bench.tokenize_cost`` runs end to end on small conversations: both tokenizers report every case,
and the ids worked out in pieces equal tokenizing whole (the bench exits non-zero otherwise). No timing
assertions."""

from __future__ import annotations

import json

import pytest

from bench.tokenize_cost import CASES, main


def test_small_run_reports_every_case_for_both_tokenizers(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--conversations", "2", "--turns", "3", "--system-words", "40", "--first-words", "30", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"vllm-sim (WordPiece)", "ChatML byte-level BPE"}
    for rows in report.values():
        for case in CASES:
            assert rows[case]["tokens"] > 40 and rows[case]["pieces_us"] > 0 and rows[case]["whole_us"] > 0
        assert rows["next turn"]["tokenized"] < rows["next turn"]["tokens"]  # the earlier turns were reused
