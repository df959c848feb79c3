"""Routing policies: given the routable nodes for one leg, pick one. No I/O, no waiting.

A policy sees the candidates (with this replica's in-flight counts and, where scraped, the node's own
queue), the nodes already tried for this request (retries go elsewhere) and an affinity key. Policies keep a
rotation counter or a random generator and nothing else, so every replica decides alike from the same pool.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.kvcache.prompt.ids import KvPrompt


class Policy(Protocol):
    name: str

    def choose(
        self,
        candidates: Sequence[NodeState],
        tried: Collection[NodeState] = (),
        key: str | None = None,
        prompt: KvPrompt | None = None,
    ) -> NodeState | None:
        """Pick a node, preferring ones not in ``tried``; None when ``candidates`` is empty (``prompt``: kv-aware's)."""


def _untried(candidates: Sequence[NodeState], tried: Collection[NodeState]) -> Sequence[NodeState]:
    if not tried:
        return candidates
    fresh = [c for c in candidates if c not in tried]
    # With every node tried once, a retry may go back to one (it may have been a passing fault).
    return fresh or candidates


def load(state: NodeState) -> int:
    """This replica's requests on the node plus the node's own queue (0 unless --scrape-load is on)."""
    return state.in_flight + state.node_waiting


class RoundRobin:
    """Each node in turn, ignoring load."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def _among(self, pool: Sequence[NodeState]) -> Sequence[NodeState]:
        return pool

    def choose(
        self,
        candidates: Sequence[NodeState],
        tried: Collection[NodeState] = (),
        key: str | None = None,
        prompt: KvPrompt | None = None,
    ) -> NodeState | None:
        pool = _untried(candidates, tried)
        if not pool:
            return None
        ordered = sorted(self._among(pool), key=lambda s: s.node.url)
        return ordered[next(self._turn) % len(ordered)]


class LeastLoad(RoundRobin):
    """Least load (``measure``, by default ``load``); round-robin among equals so ties spread evenly."""

    name = "least-load"

    def __init__(self, measure: Callable[[NodeState], int] = load) -> None:
        super().__init__()
        self._measure = measure

    def _among(self, pool: Sequence[NodeState]) -> Sequence[NodeState]:
        loads = [self._measure(s) for s in pool]
        least = min(loads)
        return [s for s, n in zip(pool, loads, strict=True) if n == least]


class PowerOfTwo:
    """Two nodes at random, the less loaded of them: near least-load balance without herding on one node."""

    name = "power-of-two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(
        self,
        candidates: Sequence[NodeState],
        tried: Collection[NodeState] = (),
        key: str | None = None,
        prompt: KvPrompt | None = None,
    ) -> NodeState | None:
        pool = _untried(candidates, tried)
        if len(pool) <= 1:
            return pool[0] if pool else None
        first, second = self._rng.sample(list(pool), 2)
        return first if load(first) <= load(second) else second


def _stable_hash(text: str) -> int:
    # Not Python's hash(): it is salted per process, and every replica must place keys alike.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class ConsistentHash:
    """Affinity: the same key (session, user, or prompt prefix) goes to the same node on every replica, so
    the node's prefix cache is reused; bounded load (each node takes at most ``1 + epsilon`` times the average)
    sends a key onward along the ring when its node is overloaded. Requests without a key: least-load."""

    name = "consistent-hash"
    VNODES = 64
    """Points per node on the ring; more points spread keys more evenly."""

    def __init__(self, epsilon: float = 0.25) -> None:
        self._epsilon = epsilon
        self._fallback = LeastLoad()
        self._ring_of: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, urls: tuple[str, ...]) -> None:
        if urls == self._ring_of:
            return
        pairs = sorted((_stable_hash(f"{url}#{i}"), url) for url in urls for i in range(self.VNODES))
        self._points = [p for p, _ in pairs]
        self._owners = [u for _, u in pairs]
        self._ring_of = urls

    def choose(
        self,
        candidates: Sequence[NodeState],
        tried: Collection[NodeState] = (),
        key: str | None = None,
        prompt: KvPrompt | None = None,
    ) -> NodeState | None:
        pool = _untried(candidates, tried)
        if key is None or len(pool) <= 1:
            return self._fallback.choose(pool, (), key)
        by_url = {s.node.url: s for s in pool}
        self._ring(tuple(sorted(by_url)))
        total = sum(load(s) for s in pool) + 1
        capacity = math.ceil(total * (1 + self._epsilon) / len(pool))
        start = bisect.bisect(self._points, _stable_hash(key))
        seen: set[str] = set()
        for i in range(len(self._owners)):
            url = self._owners[(start + i) % len(self._owners)]
            if url in seen:
                continue
            seen.add(url)
            if load(by_url[url]) < capacity:
                return by_url[url]
        return self._fallback.choose(pool, (), key)


def node_load(state: NodeState) -> int:
    """Requests on the node from every replica (its own /metrics, when scraped), but never less than this
    replica's own in flight (which is current; the scrape may be a fraction of a second old)."""
    return max(state.node_running + state.node_waiting, state.in_flight)


_MASK = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser: spreads the bits of ``key ^ node`` so that each pair ranks independently."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def _unit(value: int) -> float:
    """A 64-bit hash as a float strictly between 0 and 1 (its top 52 bits and a half: exact in a double)."""
    return ((value >> 12) + 0.5) / (1 << 52)


SLOW = 2.0
"""A node this many times slower than the median, or more, gets fewer new keys (see ``speed_weights``)."""


def speed_weights(states: Sequence[NodeState]) -> list[float]:
    """Each node's share of new keys, relative to the others, from how fast it produces tokens (its own /metrics,
    which every replica reads alike). A node no slower than ``SLOW`` times the median weighs 1; a slower one
    ``(median / its latency) ** 2``, rounded to a power of two so that replicas whose scrapes differ a little
    still agree. Squared: a node 3 times slower serves a request in 3 times the time, so it should take fewer
    than a third of the conversations for its answers to stay near the others' latency."""
    known = sorted(s.node_itl for s in states if s.node_itl)
    if not known:
        return [1.0] * len(states)
    median = known[(len(known) - 1) // 2]
    weights = []
    for state in states:
        ratio = state.node_itl / median if state.node_itl else 1.0
        weights.append(1.0 if ratio < SLOW else 2.0 ** -round(2 * math.log2(ratio)))
    return weights


class CacheAware:
    """Prefix-cache affinity with a load escape: a key's nodes are ranked by weighted rendezvous hashing, the
    same on every replica, and the request goes to the first of them that is not overloaded. A node's weight
    comes from its speed (``speed_weights``): a slow node ranks first for fewer keys, while every other key
    keeps its node. Overloaded means the node's KV cache is nearly full, or its load (its own queue and running
    requests, as every replica reads them from its /metrics) exceeds ``1 + epsilon`` times its share of the
    total (the average, when all weigh alike) by more than ``slack`` requests; then every replica sends the key
    to the same second choice. Requests without a key: least load."""

    name = "cache-aware"
    KV_FULL = 0.95

    def __init__(self, epsilon: float = 0.5, slack: int = 2) -> None:
        self._epsilon = epsilon
        self._slack = slack
        self._fallback = LeastLoad(node_load)
        self._hashes: dict[str, int] = {}
        self._latencies: list[float | None] = []
        self._weights: list[float] | None = None

    def _hash(self, text: str) -> int:
        """``_stable_hash``, remembered: node ids, and keys, which repeat with every turn of a conversation."""
        found = self._hashes.get(text)
        if found is None:
            if len(self._hashes) > 100_000:  # keys and nodes come and go: keep the table bounded
                self._hashes.clear()
            found = self._hashes[text] = _stable_hash(text)
        return found

    def _speed_weights(self, pool: Sequence[NodeState]) -> list[float] | None:
        """``speed_weights(pool)``, None when all are 1; computed again only when a latency figure changed
        (they change with a scrape, not with a request)."""
        latencies = [s.node_itl for s in pool]
        if latencies != self._latencies:
            weights = speed_weights(pool)
            self._latencies = latencies
            self._weights = None if all(w == 1.0 for w in weights) else weights
        return self._weights

    def choose(
        self,
        candidates: Sequence[NodeState],
        tried: Collection[NodeState] = (),
        key: str | None = None,
        prompt: KvPrompt | None = None,
    ) -> NodeState | None:
        pool = _untried(candidates, tried)
        if key is None or len(pool) <= 1:
            return self._fallback.choose(pool)
        weights = self._speed_weights(pool)
        # Weighted rendezvous hashing: every replica ranks the nodes for a key alike; a node that leaves moves
        # only the keys it ranked first, and a node whose weight falls loses only some of its own keys. The
        # score is -weight / ln(u) for the pair's draw u; when all weigh alike, the draws alone give its order.
        seed, node_hash = self._hash(key), self._hash
        draws = [_mix(seed ^ node_hash(s.node.node_id)) for s in pool]
        scores: Sequence[float] = draws
        if weights is not None:
            scores = [-w / math.log(_unit(d)) for d, w in zip(draws, weights, strict=True)]
        first = max(range(len(pool)), key=scores.__getitem__)
        state = pool[first]
        if state.kv_usage < self.KV_FULL and node_load(state) <= self._slack:
            return state  # within the slack whatever the others carry: the usual case, decided in O(1) more
        loads = [node_load(s) for s in pool]
        # A node's fair load is its weight's share of the total: a slow node is overloaded sooner.
        shares = weights or [1.0] * len(pool)
        fair = (1 + self._epsilon) * sum(loads) / sum(shares)
        ranked = sorted(range(len(pool)), key=scores.__getitem__, reverse=True)
        for i in ranked:
            if loads[i] <= fair * shares[i] + self._slack and pool[i].kv_usage < self.KV_FULL:
                return pool[i]
        return pool[min(ranked, key=loads.__getitem__)]


POLICIES: dict[str, type[RoundRobin] | type[PowerOfTwo] | type[ConsistentHash] | type[CacheAware]]
POLICIES = {p.name: p for p in (RoundRobin, LeastLoad, PowerOfTwo, ConsistentHash, CacheAware)}
KV_AWARE = "kv-aware"
"""By the nodes' KV-cache events (routing/kv_aware.py, built by the app with the index); else cache-aware."""
POLICY_NAMES = sorted([*POLICIES, KV_AWARE])
AFFINITY_POLICIES = frozenset([ConsistentHash.name, CacheAware.name, KV_AWARE])
"""Policies that route by an affinity key (the request's session, user or prompt prefix)."""
DEFAULT_POLICIES = {"prefill": KV_AWARE, "decode": LeastLoad.name, "mixed": KV_AWARE}
"""Per role when no policy flag is given (bench/routing.py): a prefix cache saves prefill and mixed nodes work;
a decode node only pulls the KV cache, so its load is what matters."""


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}") from None


# -- LoRA adapters (issue 19) ----------------------------------------------------------------------------------

ADAPTER_SLACK = 4
"""Requests more than the least loaded candidate a node may carry and still be preferred for its adapter."""


def prefer_adapter(candidates: list[NodeState], adapter: str) -> list[NodeState]:
    """The candidates for a request of LoRA adapter ``adapter`` that the policy then chooses among: those where
    it is active (running in the node's ``vllm:lora_requests_info``: waiting there means the node's slots are
    taken, no reason to send more); else, of those with a free
    adapter slot, its home node (ranked first by a hash of adapter and node, alike on every replica, so that an
    adapter comes back to the node that still holds it in a slot), then all of those; else all. A choice is
    skipped when even its least loaded node carries ``ADAPTER_SLACK`` more requests than the least loaded
    candidate (the adapter then spreads rather than queue on its nodes). Candidates none of which shows the gauge
    (no LoRA, or no --scrape-load) are left as they are."""
    if len(candidates) <= 1 or all(s.max_loras is None for s in candidates):
        return candidates

    def tier(state: NodeState) -> int:
        if adapter in state.lora_running:
            return 0
        slots = state.max_loras
        # Requests of some adapter waiting there: its slots are taken, however many the gauge says run.
        return 1 if slots is None or (len(state.lora_running) < slots and not state.lora_waiting) else 2

    loads = {id(s): node_load(s) for s in candidates}
    bound = min(loads.values()) + ADAPTER_SLACK
    tiers = [tier(s) for s in candidates]
    active = [s for s, t in zip(candidates, tiers, strict=True) if t == 0]
    if active and min(loads[id(s)] for s in active) < bound:
        return active
    free = [s for s, t in zip(candidates, tiers, strict=True) if t == 1]
    if free:
        home = max(free, key=lambda s: _stable_hash(f"{adapter}#{s.node.node_id}"))
        if loads[id(home)] < bound:
            return [home]
        either = active + free
        if len(either) < len(candidates) and min(loads[id(s)] for s in either) < bound:
            return either
    return candidates
