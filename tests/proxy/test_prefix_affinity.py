"""The affinity key comes from the part of the prompt a conversation keeps, whatever preamble many share; and
the cache-aware policy sends a key to the same node on every replica unless that node is overloaded."""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm_etcd_proxy.fleet.records import Node, Role
from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.routing.affinity import BLOCK, PrefixIndex, prompt_bytes, route_hints
from vllm_etcd_proxy.proxy.routing.balancer import CacheAware, _unit

PREAMBLE = "You are a helpful assistant. Follow the house rules below. " * 200  # ~12 KB, shared by every session


def chat(session: int, turns: int, preamble: str = PREAMBLE) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": preamble},
        {"role": "user", "content": f"session {session}: tell me about topic {session * 7919} " * 3},
    ]
    for turn in range(1, turns):
        messages += [
            {"role": "assistant", "content": f"answer {turn} of session {session} " * 5},
            {"role": "user", "content": f"and then {turn}?"},
        ]
    return {"model": "m", "messages": messages}


def completion(session: int, turns: int, preamble: str = PREAMBLE) -> dict[str, Any]:
    # A chat kept as text, as completion clients do: turns on their own lines, the prompt ending in "A:".
    prompt = preamble + f"\nQ: what is {session * 104729}?\nA:"
    for turn in range(1, turns):
        prompt += f" answer {turn} for {session}.\nQ: more {turn}?\nA:"
    return {"model": "m", "prompt": prompt}


def test_every_turn_of_a_conversation_has_the_same_key_and_conversations_differ() -> None:
    for build in (chat, completion):
        index = PrefixIndex()
        keys: dict[int, set[str | None]] = {}
        for turns in range(1, 7):
            for session in range(8):
                keys.setdefault(session, set()).add(route_hints(index, build(session, turns), None).key)
        # The very first request cannot know the preamble is shared: session 0's first turn is keyed on the
        # preamble. From the second session on, a replica knows, and every turn has its conversation's key.
        assert len(keys[0]) == 2
        assert all(len(keys[s]) == 1 for s in range(1, 8)), (build.__name__, keys)
        assert len(set.union(*keys.values())) == 9, build.__name__


def test_a_preamble_longer_than_each_sessions_own_part_does_not_merge_sessions() -> None:
    index = PrefixIndex()
    long_preamble = "x" * (50 * BLOCK)
    for turns in (1, 2, 3):
        keys = {route_hints(index, chat(s, turns, long_preamble), None).key for s in range(16)}
    assert len(keys) == 16


def test_token_id_prompts_are_keyed_like_text() -> None:
    index = PrefixIndex()
    shared = list(range(1000, 1400))
    keys = [
        {route_hints(index, {"prompt": shared + [s] * 40 + [7] * turn}, None).key for turn in range(3)}
        for s in range(5)
    ]
    assert all(len(k) == 1 for k in keys[1:]) and len({next(iter(k)) for k in keys[1:]}) == 4


def test_a_session_header_or_user_wins() -> None:
    index = PrefixIndex()
    assert route_hints(index, chat(1, 1), "abc").key == "session:abc"
    assert route_hints(index, {**chat(1, 1), "user": "u1"}, None).key == "user:u1"


def test_vllms_session_id_field_names_the_conversation_as_the_header_does() -> None:
    index = PrefixIndex()
    by_field = route_hints(index, {**chat(1, 1), "session_id": "abc", "user": "u1"}, None).key
    assert by_field == route_hints(index, chat(2, 3), "abc").key == "session:abc"


def test_requests_with_different_cache_salts_are_never_one_conversation() -> None:
    index = PrefixIndex()
    turns = [chat(1, turn) for turn in range(1, 4)]
    for named in ({}, {"session_id": "s"}, {"user": "u"}):
        keys = {
            salt: {route_hints(index, {**t, **named, "cache_salt": salt}, None).key for t in turns}
            for salt in ("tenant-a", "tenant-b")
        }
        assert all(len(k) == 1 for k in keys.values()), keys  # each salt: one conversation across its turns
        assert keys["tenant-a"] != keys["tenant-b"]


def nodes(count: int) -> list[NodeState]:
    return [
        NodeState(node=Node(node_id=f"n{i}:1", role=Role.MIXED, url=f"http://n{i}:1", models=("m",)))
        for i in range(count)
    ]


def test_cache_aware_sends_a_key_to_the_same_node_on_every_replica_and_spreads_keys() -> None:
    a, b = CacheAware(), CacheAware()
    pool_a, pool_b = nodes(4), nodes(4)
    homes = Counter()
    for key in (f"prefix:{i:x}" for i in range(400)):
        first = a.choose(pool_a, key=key)
        assert first is not None and first.node.url == b.choose(pool_b[::-1], key=key).node.url  # type: ignore[union-attr]
        homes[first.node.node_id] += 1
    assert len(homes) == 4 and max(homes.values()) < 140


def test_cache_aware_moves_a_key_only_off_a_really_overloaded_node_and_all_replicas_agree() -> None:
    pool = nodes(4)
    key = "prefix:beef"
    home = CacheAware().choose(pool, key=key)
    assert home is not None
    for state in pool:
        state.node_running = 4
    home.node_running = 7  # busier than the rest, not overloaded: the key stays
    assert CacheAware().choose(pool, key=key) is home
    home.node_running, home.node_waiting = 12, 5  # a queue far above the others: the key moves
    second = {CacheAware().choose(pool, key=key).node.node_id for _ in range(5)}  # type: ignore[union-attr]
    assert len(second) == 1 and home.node.node_id not in second
    home.node_running, home.node_waiting, home.kv_usage = 1, 0, 0.99  # KV cache full: moves too
    assert CacheAware().choose(pool, key=key) is not home


def test_cache_aware_sends_a_request_without_key_to_the_least_loaded_node_as_every_replica_sees_it() -> None:
    pool = nodes(3)
    pool[0].node_running, pool[1].node_running, pool[2].node_running = 5, 1, 1  # scraped: all replicas' requests
    pool[2].in_flight = 3  # this replica's own, newer than the last scrape
    policy = CacheAware()
    assert {policy.choose(pool).node.node_id for _ in range(4)} == {"n1:1"}  # type: ignore[union-attr]
    pool[2].in_flight = 1
    picks = Counter(policy.choose(pool).node.node_id for _ in range(6))  # type: ignore[union-attr]
    assert picks == {"n1:1": 3, "n2:1": 3}  # equals take turns


def test_the_known_part_of_a_prompt_reaches_past_a_shared_preamble_into_the_conversations_own_turns() -> None:
    index = PrefixIndex()
    for session in range(3):  # the preamble is shared
        for turns in (1, 2, 3):
            found = prompt_bytes(completion(session, turns))
            assert found is not None
            index.read(found[0])
    turn_3, turn_4 = prompt_bytes(completion(1, 3)), prompt_bytes(completion(1, 4))
    assert turn_3 is not None and turn_4 is not None
    prefix = index.read(turn_4[0])
    # Everything turn 3 sent, up to its unfinished last line ("A:"), was seen before: it is likely cached.
    assert prefix.known == turn_3[0].rindex(b"\n") + 1, (len(turn_3[0]), prefix.known)


def homes(policy: CacheAware, pool: list[NodeState], keys: int = 2000) -> dict[str, str]:
    found = {}
    for key in (f"prefix:{i:x}" for i in range(keys)):
        chosen = policy.choose(pool, key=key)
        assert chosen is not None
        found[key] = chosen.node.node_id
    return found


def test_a_slow_node_gets_fewer_keys_and_every_other_key_keeps_its_node() -> None:
    pool = nodes(4)
    for state in pool:
        state.node_itl = 0.005
    replica = CacheAware()  # one policy across the changes, as in a running replica
    before = homes(replica, pool)
    slow = pool[3]
    slow.node_itl = 0.015  # 3 times slower than the others, as every replica reads it from the node's /metrics
    after = homes(replica, pool)
    assert after == homes(CacheAware(), pool[::-1])  # another replica, the same answer
    on_slow = Counter(after.values())[slow.node.node_id]
    assert 0 < on_slow < Counter(before.values())[slow.node.node_id] / 4
    # Only keys that lived on the slow node moved; none moved between the fast ones.
    assert all(after[k] == home for k, home in before.items() if home != slow.node.node_id)
    slow.node_itl = 0.005  # recovered: its keys come back
    assert homes(replica, pool) == before


def test_small_differences_in_speed_move_no_key() -> None:
    pool = nodes(4)
    before = homes(CacheAware(), pool)  # no latency scraped yet
    for state, itl in zip(pool, (0.005, 0.006, 0.0045, 0.009), strict=True):
        state.node_itl = itl  # within 2 x the median: noise, not a slow node
    assert homes(CacheAware(), pool) == before


def test_a_slow_node_counts_as_overloaded_at_a_load_a_fast_node_keeps() -> None:
    pool = nodes(4)
    for state in pool:
        state.node_itl, state.node_running = 0.005, 3
    slow = pool[3]
    slow.node_itl, slow.node_running = 0.015, 2
    found = homes(CacheAware(), pool, keys=4000)  # nobody overloaded
    assert any(home == slow.node.node_id for home in found.values())
    slow.node_running = 4  # a fast node at 4 would keep its keys; the slow one, weighing 1/8, lets them go
    again = homes(CacheAware(), pool, keys=4000)
    assert slow.node.node_id not in again.values()
    assert again == homes(CacheAware(), pool[::-1], keys=4000)
    assert all(again[k] == home for k, home in found.items() if home != slow.node.node_id)


def test_the_rendezvous_draw_stays_strictly_between_0_and_1_at_the_hash_extremes() -> None:
    # -weight / ln(u) must be finite for every hash, or one key in 2^54 would crash the ranking.
    assert 0.0 < _unit(0) < _unit((1 << 64) - 1) < 1.0
