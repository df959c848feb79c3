"""Running a benchmark of ``bench/`` the way a user does, for its smoke test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent


def run_bench(module: str, *args: str, timeout: float = 120) -> dict[str, Any]:
    """``python -m MODULE ARGS --json`` from the repository root; its JSON report (the run must exit 0)."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def still_running(pids: dict[str, int]) -> list[str]:
    """The names of the processes in ``pids`` that are still alive."""
    alive = []
    for name, pid in pids.items():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(name)
    return alive
