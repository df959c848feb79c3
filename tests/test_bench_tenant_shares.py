"""``python -m bench.tenant_shares`` runs end to end on a short load: every tenant of every fleet reported, against
the one-replica reference, and no request failed. No timing assertions: the machine may be busy."""

from __future__ import annotations

from tests.support.bench import run_bench


def test_the_tenant_shares_bench_reports_every_tenant_against_one_replica() -> None:
    patterns = ("one", "split", "pause", "all")
    report = run_bench(
        "bench.tenant_shares",
        *("--seconds", "6", "--replicas", "2", "--pause", "1", "--build", "now=.", "--patterns", *patterns),
        timeout=180,
    )
    assert report["ok"] is True and report["failed"] == 0
    assert set(report["fleets"]) == {"now/2"}
    fleet = report["fleets"]["now/2"]
    # At most one put a second per replica: over a short run, one more than its seconds (a put at each end).
    assert len(fleet["tenants"]) == 3 * len(patterns) and 0 < fleet["puts_per_replica"] <= fleet["seconds"] + 1
    for name, tenant in fleet["tenants"].items():
        assert tenant["admitted"] > 0 and tenant["minute"] is not None, name
    assert all(report["reference"][name] > 0 for name in fleet["tenants"])
    assert fleet["tenants"]["concurrency-all"]["peak_in_flight"] <= 10
