"""``make demo`` works: ``DEMO_ONESHOT=1 python -m tests.demo`` brings the fleet up, every request through every
replica succeeds, and it tears everything down and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120.0
"""Generous: the demo takes ~15 s on a laptop; a loaded CI machine may take a few times longer."""


def _logs(log_dir: Path) -> str:
    parts = []
    for path in sorted(log_dir.glob("*.log")):
        tail = "\n".join(path.read_text(errors="replace").splitlines()[-15:])
        parts.append(f"--- {path.name} (last lines) ---\n{tail}")
    return "\n".join(parts)


def test_demo_oneshot_sends_every_request_through_every_replica_and_exits_zero(tmp_path: Path) -> None:
    env = {**os.environ, "DEMO_ONESHOT": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    # cwd is a temporary directory, so the demo's ./demo-logs/ lands there and not in the work tree.
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.demo"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the demo tears its processes down on SIGTERM
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"demo still running after {TIMEOUT}s:\n{output}\n{_logs(tmp_path / 'demo-logs')}")
    assert proc.returncode == 0, f"demo exited {proc.returncode}:\n{output}\n{_logs(tmp_path / 'demo-logs')}"
    assert "All 4 requests succeeded." in output, output
    assert output.count("answered by decode-") == 4, output
    assert "Stopped." in output, output
