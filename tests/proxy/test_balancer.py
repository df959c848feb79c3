"""Routing policies as pure functions of the candidates."""

from __future__ import annotations

import random
from collections import Counter

from vllm_etcd_proxy.fleet.records import Node, Role
from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.routing.balancer import ConsistentHash, LeastLoad, PowerOfTwo, RoundRobin, make_policy


def nodes(count: int) -> list[NodeState]:
    return [
        NodeState(node=Node(node_id=f"n{i}:1", role=Role.DECODE, url=f"http://n{i}:1", models=("m",)))
        for i in range(count)
    ]


def test_round_robin_visits_every_node_in_turn() -> None:
    pool, policy = nodes(3), RoundRobin()
    picks = [policy.choose(pool) for _ in range(6)]
    assert Counter(id(p) for p in picks) == {id(s): 2 for s in pool}


def test_least_load_prefers_fewer_in_flight_and_spreads_ties() -> None:
    pool, policy = nodes(3), LeastLoad()
    pool[0].in_flight, pool[1].in_flight, pool[2].in_flight = 5, 1, 1
    picks = {policy.choose(pool).node.node_id for _ in range(4)}  # type: ignore[union-attr]
    assert picks == {"n1:1", "n2:1"}


def test_least_load_counts_the_nodes_own_queue() -> None:
    pool, policy = nodes(2), LeastLoad()
    pool[0].node_waiting = 10
    pool[1].in_flight = 3
    assert policy.choose(pool) is pool[1]


def test_retries_go_to_an_untried_node_while_there_is_one() -> None:
    pool = nodes(3)
    for policy in (RoundRobin(), LeastLoad(), PowerOfTwo(random.Random(1)), ConsistentHash()):
        for _ in range(10):
            assert policy.choose(pool, tried=pool[:2], key="k") is pool[2]
        assert policy.choose(pool, tried=pool, key="k") in pool


def test_power_of_two_never_picks_the_busiest_of_three() -> None:
    pool, policy = nodes(3), PowerOfTwo(random.Random(7))
    pool[0].in_flight = 9
    assert all(policy.choose(pool) is not pool[0] for _ in range(50))


def test_consistent_hash_sends_a_key_to_the_same_node_on_every_replica() -> None:
    replica_a, replica_b = ConsistentHash(), ConsistentHash()
    pool_a, pool_b = nodes(5), nodes(5)
    for key in (f"session:{i}" for i in range(50)):
        assert replica_a.choose(pool_a, key=key).node.url == replica_b.choose(pool_b[::-1], key=key).node.url  # type: ignore[union-attr]


def test_consistent_hash_moves_few_keys_when_a_node_leaves() -> None:
    policy, pool = ConsistentHash(), nodes(5)
    keys = [f"session:{i}" for i in range(400)]
    before = {k: policy.choose(pool, key=k).node.url for k in keys}  # type: ignore[union-attr]
    after = {k: policy.choose(pool[1:], key=k).node.url for k in keys}  # type: ignore[union-attr]
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == pool[0].node.url for k in moved)


def test_consistent_hash_spills_over_when_the_keys_node_is_overloaded() -> None:
    policy, pool = ConsistentHash(epsilon=0.25), nodes(4)
    home = policy.choose(pool, key="hot")
    assert home is not None
    home.in_flight = 10
    spill = policy.choose(pool, key="hot")
    assert spill is not home and spill is not None


def test_unknown_policy_names_the_known_ones() -> None:
    try:
        make_policy("fastest")
    except ValueError as exc:
        assert "consistent-hash" in str(exc) and "least-load" in str(exc)
    else:
        raise AssertionError("no error")


def test_an_adapters_requests_prefer_nodes_where_it_is_active_then_a_free_slot_unless_they_are_much_busier() -> None:
    """Tiers: active, then a free slot (its home node first), then all; without the gauge, no preference."""
    from vllm_etcd_proxy.proxy.routing.balancer import ADAPTER_SLACK, prefer_adapter

    active, free, full = nodes(3)
    active.lora_running, active.max_loras = frozenset({"sql", "x"}), 2
    free.lora_running, free.max_loras = frozenset({"x"}), 2
    full.lora_running, full.max_loras = frozenset({"x", "y"}), 2
    assert prefer_adapter([active, free, full], "sql") == [active]
    assert prefer_adapter([free, full], "sql") == [free]
    full.lora_running, full.lora_waiting = frozenset(), frozenset({"y"})  # slots taken: something waits there
    assert prefer_adapter([free, full], "sql") == [free]
    full.lora_running, full.lora_waiting = frozenset({"x", "y"}), frozenset()
    active.in_flight = ADAPTER_SLACK
    assert prefer_adapter([active, free, full], "sql") == [free]
    free.in_flight = ADAPTER_SLACK
    assert prefer_adapter([active, free, full], "sql") == [active, free, full]
    plain = nodes(3)
    assert prefer_adapter(plain, "sql") == plain
