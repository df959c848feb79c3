"""The prefix cache as a pure object: what hits, what is cached when, what is evicted, what usage reads."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_etcd_proxy.sim.prefix_cache import PrefixCache, block_hashes

BS = 4


def run(cache: PrefixCache, prompt: Sequence[int], generated: Sequence[int] = ()) -> int:
    """One request from scheduling to its end; returns its hit tokens."""
    lease = cache.admit(prompt)
    lease.tokens += len(generated)
    cache.release(lease, generated)
    return lease.hit_tokens


def test_blocks_are_chained_so_equal_hashes_mean_equal_prefixes() -> None:
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS), block_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]
    assert block_hashes([5, 6, 7, 8], BS, a[0]) == [a[1]]


def test_hits_are_leading_full_blocks_and_the_last_prompt_token_is_always_computed() -> None:
    cache = PrefixCache(block_size=BS, capacity=100)
    prompt = list(range(12))
    assert run(cache, prompt) == 0
    assert run(cache, prompt) == 8, "12 tokens: at most (12 - 1) // 4 = 2 blocks may hit"
    assert run(cache, [*prompt, 99]) == 12
    assert run(cache, [*prompt[:6], 7, 7, 7, 7, 7, 7]) == 4
    assert run(cache, [0, 1, 2]) == 0, "a partial block never hits"
    assert (cache.queries, cache.hits) == (12 + 12 + 13 + 12 + 3, 8 + 12 + 4)


def test_blocks_completed_by_generated_tokens_are_cached_when_the_request_ends() -> None:
    cache = PrefixCache(block_size=BS, capacity=100)
    prompt, answer = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]
    run(cache, prompt, answer)
    # All but the last generated token have KV: 10 tokens, 2 full blocks.
    assert run(cache, [*prompt, *answer, 12, 13]) == 8
    assert cache.cached_blocks == 3


def test_least_recently_freed_blocks_are_evicted_first_tail_blocks_before_their_prefix() -> None:
    cache = PrefixCache(block_size=BS, capacity=4)
    first, second = list(range(8)), list(range(100, 108))
    run(cache, first)
    run(cache, second)
    assert cache.cached_blocks == 4
    run(cache, list(range(200, 204)))  # one new block evicts first's tail block
    assert run(cache, [*first, 50]) == 4
    assert cache.cached_blocks <= 4


def test_blocks_of_running_requests_are_never_evicted_and_count_as_used() -> None:
    cache = PrefixCache(block_size=BS, capacity=4)
    running = cache.admit(list(range(10)))  # 2 full blocks pinned + 1 partial
    assert (cache.used_blocks, cache.usage) == (3, 0.75)
    run(cache, list(range(100, 112)))
    assert cache.admit(list(range(9))).hit_tokens == 8
    running.tokens += 8
    assert cache.usage == 1.0, "past capacity usage reads full; nothing is preempted"
    cache.release(running, list(range(8)))


def test_cached_but_unreferenced_blocks_count_as_free() -> None:
    cache = PrefixCache(block_size=BS, capacity=10)
    run(cache, list(range(9)), [1])
    assert (cache.cached_blocks, cache.used_blocks, cache.usage) == (2, 0, 0.0)


def test_zero_capacity_disables_caching_and_its_stats() -> None:
    cache = PrefixCache(block_size=BS, capacity=0)
    assert run(cache, list(range(9))) == 0 and run(cache, list(range(9))) == 0
    assert (cache.queries, cache.hits, cache.cached_blocks, cache.usage) == (0, 0, 0, 0.0)


def test_requests_with_different_cache_salts_never_share_blocks() -> None:
    cache = PrefixCache(block_size=BS, capacity=100)
    prompt = list(range(12))
    lease = cache.admit(prompt, "alice")
    cache.release(lease, [])
    assert cache.admit(prompt, "bob").hit_tokens == 0
    assert cache.admit(prompt).hit_tokens == 0
    assert cache.admit(prompt, "alice").hit_tokens == 8
