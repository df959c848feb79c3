"""``python -m bench.kv_late_replica --quick`` runs end to end on real processes: a replica started beside nodes
that already cache prompts is ready only after their replays, and its first request and every next turn go to the
node holding the prefix. No timing assertions."""

from __future__ import annotations

from tests.support.bench import run_bench


def test_a_late_replica_routes_its_first_requests_on_what_the_nodes_already_cache() -> None:
    report = run_bench("bench.kv_late_replica", "--quick", timeout=90)
    assert report["ok"] is True
    for run in report["runs"]:
        assert run["first_indexed"] is not None
        assert run["next_turns"] > 0 and run["on_their_node"] == run["next_turns"]
