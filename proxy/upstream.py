"""HTTP clients to the nodes: one connection pool per node.

httpcore's pool scans every connection it holds on each request (twice or more), and that scan grows
faster than linearly with idle connections; one pool shared by a whole fleet would make every request pay
for every node's connections. A pool per node keeps the scan to that node's own connections. Pools of
nodes that left are closed once nothing is in flight on them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import httpx


class NodeClients:
    """``acquire(url)`` the client for a node while a request is open on it, ``release(url)`` after."""

    def __init__(self, make: Callable[[], httpx.AsyncClient]) -> None:
        self._make = make
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._open: dict[str, int] = {}

    def acquire(self, url: str) -> httpx.AsyncClient:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = self._make()
        self._open[url] = self._open.get(url, 0) + 1
        return client

    def release(self, url: str) -> None:
        self._open[url] -= 1

    async def prune(self, live: Iterable[str]) -> None:
        """Close the pools of nodes no longer known, unless a request is still open on them."""
        keep = set(live)
        for url in [u for u in self._clients if u not in keep and not self._open.get(u)]:
            client = self._clients.pop(url)
            self._open.pop(url, None)
            await client.aclose()

    def __len__(self) -> int:
        return len(self._clients)

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()
