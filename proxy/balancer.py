"""Routing policies: given the routable nodes for one leg, pick one. No I/O, no waiting.

A policy sees only the candidates (with their in-flight counts) and the nodes already tried for this
request, so retries go elsewhere. Policies keep a rotation counter and nothing else.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Protocol

from proxy.pool import NodeState


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[NodeState], tried: Collection[NodeState] = ()) -> NodeState | None:
        """Pick a node, preferring ones not in ``tried``; None when ``candidates`` is empty."""


def _untried(candidates: Sequence[NodeState], tried: Collection[NodeState]) -> Sequence[NodeState]:
    if not tried:
        return candidates
    fresh = [c for c in candidates if c not in tried]
    # With every node tried once, a retry may go back to one (it may have been a passing fault).
    return fresh or candidates


class RoundRobin:
    """Each node in turn, ignoring load."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[NodeState], tried: Collection[NodeState] = ()) -> NodeState | None:
        pool = _untried(candidates, tried)
        if not pool:
            return None
        ordered = sorted(pool, key=lambda s: s.node.url)
        return ordered[next(self._turn) % len(ordered)]


class LeastLoad:
    """Fewest requests in flight from this replica; round-robin among equals so ties spread evenly."""

    name = "least-load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[NodeState], tried: Collection[NodeState] = ()) -> NodeState | None:
        pool = _untried(candidates, tried)
        if not pool:
            return None
        least = min(s.in_flight for s in pool)
        ties = sorted((s for s in pool if s.in_flight == least), key=lambda s: s.node.url)
        return ties[next(self._turn) % len(ties)]


POLICIES: dict[str, type[RoundRobin] | type[LeastLoad]] = {RoundRobin.name: RoundRobin, LeastLoad.name: LeastLoad}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}") from None
