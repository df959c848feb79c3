"""``python -m bench.kv_ingest --quick --json`` runs end to end on real processes: simulated publishers in
processes of their own, a replica following them while requests route on its index, and every figure the
benchmark reports present, every batch taken in, every request on the node holding its prefix, and every
process it started gone afterwards. No timing assertions."""

from __future__ import annotations

from tests.support.bench import run_bench, still_running


def test_quick_run_takes_in_every_batch_and_routes_every_request_on_its_prefix() -> None:
    report = run_bench("bench.kv_ingest", "--quick", timeout=150)
    assert report["ok"] is True
    (replica,) = report["replicas"].values()
    checks = replica["integrity"]
    assert checks["published"] > 0 and checks["applied"] == checks["published"]
    assert checks["lost"] == checks["misread_nodes"] == checks["malformed"] == 0
    for phase in ("quiet", "flowing"):
        assert replica[phase]["requests"] > 0 and replica[phase]["misrouted"] == 0
        assert replica[phase]["latency_p99_ms"] >= replica[phase]["latency_p50_ms"] > 0
    assert replica["flowing"]["applied_per_s"] > 0 and replica["flowing"]["lag_samples"] > 0
    assert replica["blocks_indexed"] > 0
    assert still_running(report["server_pids"]) == []
