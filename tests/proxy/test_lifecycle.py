"""A replica's own shutdown: not ready first (for the balancer), still serving, then a clean exit 0."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.conftest import Reaper
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode


def test_sigterm_reports_not_ready_while_still_serving_then_exits_zero(logs_dir: Path, reap: Reaper) -> None:
    node = reap(SimNode(logs_dir, "node", role="mixed").start())
    replica = reap(ProxyProc(logs_dir, "--mixed", node.host_port, "--shutdown-delay", "3"))
    replica.wait_routable("mixed", node.host_port)
    assert replica.get("/ready").status_code == 200
    replica.proc.signal(signal.SIGTERM)
    wait_until(lambda: replica.get("/ready").status_code == 503, 2, "not ready after SIGTERM")
    assert replica.get("/ready").json()["reason"] == "shutting down"
    answer = replica.post("/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 2})
    assert answer.status_code == 200
    assert replica.proc.wait(15) == 0
