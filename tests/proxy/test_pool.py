"""The pool's indexes stay what a full scan would say, node by node, and its listeners hear of one node at a time."""

from __future__ import annotations

from dataclasses import replace

from vllm_etcd_proxy.fleet.records import Node, Role, Sleep, Status
from vllm_etcd_proxy.proxy.discovery.events import PoolEvent, Remove, Snapshot, Upsert
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool


def node(
    i: int, *, role: Role = Role.MIXED, models: tuple[str, ...] = ("m",), status: Status = Status.SERVING, port: int = 1
) -> Node:
    """Node ``i``; another ``port`` is another server under the same key."""
    host = f"127.0.{i // 250}.{i % 250}"  # the pool does no I/O: nothing is contacted
    return Node(
        node_id=f"{host}:{port}",
        role=role,
        url=f"http://{host}:{port}",
        models=models,
        status=status,
        key=f"/vllm/default/{role.value}/{host}:1",
        learn_models=not models,
    )


STEPS: list[list[PoolEvent]] = [
    [Snapshot(nodes=(node(1), node(2, models=("m", "n")), node(3, role=Role.PREFILL), node(4, models=())), revision=1)],
    [Upsert(node=node(5), revision=2), Upsert(node=node(6, role=Role.DECODE, models=("n",)), revision=3)],
    [Upsert(node=node(1, status=Status.DRAINING), revision=4)],  # drains: out of the candidates
    [Upsert(node=node(2, models=("n",)), revision=5)],  # stops serving m
    [Upsert(node=node(5, port=2), revision=6)],  # same key, another server: a new state
    [Remove(key=node(3, role=Role.PREFILL).key or "", revision=7), Upsert(node=node(1), revision=8)],
    [Snapshot(nodes=(node(1), node(6, role=Role.DECODE, models=("n",)), node(7)), revision=9)],
]
"""Discovery's batches, in order: every kind of change a node's index entries depend on."""


def scanned(pool: Pool, role: Role, model: str) -> set[str]:
    return {s.entry_key for s in pool.all() if s.node.role is role and model in s.models and s.routable}


def check_indexes(pool: Pool) -> None:
    for role in Role:
        for model in ("m", "n", "learned"):
            assert {s.entry_key for s in pool.candidates(role, model)} == scanned(pool, role, model), (role, model)
    assert {s.entry_key for s in pool.routable()} == {s.entry_key for s in pool.all() if s.routable}
    assert pool.models() == sorted({m for s in pool.all() if s.routable for m in s.models})
    assert {s.entry_key for s in pool.ejected()} == {s.entry_key for s in pool.all() if s.ejected}


def test_indexes_match_a_full_scan_after_every_batch() -> None:
    pool = Pool()
    for batch in STEPS:
        pool.apply_all(batch)
        check_indexes(pool)
        for state in pool.all():
            if not state.node.models and not state.learned:
                pool.set_learned_models(state, ["learned"])
                check_indexes(pool)
        first = pool.all()[0]
        pool.set_ejected(first, True)
        check_indexes(pool)
        pool.set_ejected(first, False)
        check_indexes(pool)


def test_listeners_hear_only_of_the_nodes_a_batch_touched() -> None:
    pool = Pool()
    pool.apply_all([Snapshot(nodes=tuple(node(i) for i in range(1000)), revision=1)])
    heard: list[NodeState] = []
    pool.on_node(heard.append)
    pool.apply_all([Upsert(node=node(1001), revision=2)])
    assert [s.node.node_id for s in heard] == ["127.0.4.1:1"]
    heard.clear()
    pool.apply_all([Upsert(node=node(1001), revision=3)])  # a re-put that changed nothing
    assert heard == []
    pool.set_ejected(pool.all()[0], True)
    assert heard == [pool.all()[0]]


def test_a_model_counts_as_in_demand_from_its_first_request() -> None:
    pool = Pool()
    pool.apply_all([Snapshot(nodes=(node(1), node(2, models=("n",))), revision=1)])
    asked: list[str] = []
    pool.on_demand(asked.append)
    first, second = pool.all()
    assert not pool.in_demand(first)
    pool.candidates(Role.MIXED, "m")
    pool.candidates(Role.MIXED, "m")
    assert asked == ["m"]  # once, not per request
    assert pool.in_demand(first) and not pool.in_demand(second)
    assert pool.serving("m") == [first]


def test_a_node_marked_for_sleep_leaves_the_candidates_and_is_awake_again_once_the_mark_is_cleared() -> None:
    pool = Pool()
    pool.apply(Snapshot(nodes=(node(1), node(2)), revision=1))
    first = pool.get(node(1).key or "")
    assert first is not None
    pool.set_asleep(first, True)  # its /metrics said so
    pool.apply(Upsert(node=replace(node(1), sleep=Sleep.ASLEEP), revision=2))
    assert [s.node.node_id for s in pool.candidates(Role.MIXED, "m")] == [node(2).node_id]
    assert pool.sleeping("m") == [first] and not first.routable
    pool.apply(Upsert(node=node(1), revision=3))  # woken: whoever woke it cleared the mark
    assert not first.asleep and first in pool.candidates(Role.MIXED, "m") and pool.sleeping("m") == []
    pool.set_sleep_mark(first, Sleep.DRAINING)  # a node without etcd: marked in memory
    assert first not in pool.candidates(Role.MIXED, "m") and first.node.sleep is Sleep.DRAINING
