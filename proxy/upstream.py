"""HTTP clients to the nodes: connection pools per node, each kept small.

httpcore's pool scans every connection it holds on each request (twice or more), and the scan grows faster
than linearly with idle connections. So a node gets its own pools, and a new pool is opened for it once every
existing one has ``SHARD_SIZE`` requests open: each request's scan stays over a few connections whether the
fleet has one node or a hundred, and one node carries one request or a thousand. Pools of nodes that left
are closed once nothing is in flight on them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import httpx

SHARD_SIZE = 8
"""Requests open on one pool before the node gets another pool."""


@dataclass(eq=False)
class Shard:
    """One connection pool of a node and the requests open on it."""

    client: httpx.AsyncClient
    open: int = 0


class NodeClients:
    """``acquire(url)`` a pool for a request to a node, ``release(shard)`` when the request is over."""

    def __init__(self, make: Callable[[], httpx.AsyncClient]) -> None:
        self._make = make
        self._shards: dict[str, list[Shard]] = {}

    def acquire(self, url: str) -> Shard:
        shards = self._shards.setdefault(url, [])
        shard = min(shards, key=lambda s: s.open, default=None)
        if shard is None or shard.open >= SHARD_SIZE:
            shard = Shard(client=self._make())
            shards.append(shard)
        shard.open += 1
        return shard

    def release(self, shard: Shard) -> None:
        shard.open -= 1

    async def prune(self, live: Iterable[str]) -> None:
        """Close the pools of nodes no longer known, unless a request is still open on them."""
        keep = set(live)
        for url in [u for u in self._shards if u not in keep]:
            shards = self._shards[url]
            if any(s.open for s in shards):
                continue
            del self._shards[url]
            for shard in shards:
                await shard.client.aclose()

    def __len__(self) -> int:
        return sum(len(shards) for shards in self._shards.values())

    async def aclose(self) -> None:
        shards, self._shards = [s for group in self._shards.values() for s in group], {}
        for shard in shards:
            await shard.client.aclose()
