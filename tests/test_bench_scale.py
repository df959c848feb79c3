"""``python -m bench.scale --quick --json``: 1,000 nodes registered at once with 2 replicas watching. Every replica
sees every node soon after the last put, an idle replica holding them costs little, and every server the run
started is gone afterwards. The deadline is generous (the machine may be busy); CPU and memory are the replicas'
own, which other users of the machine do not change much."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.bench import run_bench, still_running


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run_bench("bench.scale", "--quick", timeout=120)


def test_every_replica_sees_every_node_soon_after_the_last_put(report: dict[str, Any]) -> None:
    assert report["ok"] is True
    assert all(b["failed"] == 0 for b in report["bursts"].values())
    assert len(report["seen_after_last_put_s"]) == 2
    assert report["seen_max_s"] is not None and report["seen_max_s"] < 10.0


def test_an_idle_replica_holding_the_nodes_costs_little(report: dict[str, Any]) -> None:
    assert report["idle_cores_max"] < 0.25
    assert report["rss_delta_mb_max"] < 60


def test_the_scale_bench_stops_every_server_it_started(report: dict[str, Any]) -> None:
    assert set(report["server_pids"]) == {"etcd", "replica0", "replica1"}
    assert still_running(report["server_pids"]) == []
