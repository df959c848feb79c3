"""How many replicas share the fleet's limits: each puts ``{prefix}/{cluster}/replicas/{id}`` under a lease of
its own and every replica counts the keys of that folder (a discovery sink), itself included.

A replica that dies stops refreshing its lease and leaves the count within the TTL; one that is cut off from
etcd keeps the count it last saw (and its key expires for the others, who then enforce a larger share until it
is back). Without etcd the count is the replica's ``--workers`` (each worker is a replica of its own).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable, Mapping

from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdError, LeaseLost
from vllm_etcd_proxy.fleet.records import KeyLayout

log = logging.getLogger(__name__)

FOLDER = "replicas"
REPLICA_TTL = 10
"""Seconds a dead replica's key outlives it: the longest time the others enforce too small a share."""
REVOKE_TIMEOUT = 3.0
RETRY_MAX = 2.0


def replica_id() -> str:
    """Unique per process (every worker of ``--workers`` enforces its own share)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ReplicaCount:
    """The live replicas, from the ``replicas/`` folder (a ``KeySink``); ``count`` is at least ``least``."""

    def __init__(self, me: str, on_change: Callable[[int], None] | None = None, *, least: int = 1) -> None:
        self.me = me
        self._names: set[str] = set()
        self._least = least
        self.count = least
        self._on_change = on_change
        if on_change is not None:
            on_change(least)

    def _update(self) -> None:
        count = max(self._least, len(self._names | {self.me}))
        if count != self.count:
            log.info("replicas sharing the limits: %d", count)
            if self._on_change is not None:
                self._on_change(count)
        self.count = count

    def replace(self, entries: Mapping[str, bytes]) -> Mapping[str, str]:
        self._names = set(entries)
        self._update()
        return {}

    def put(self, name: str, value: bytes) -> str | None:
        self._names.add(name)
        self._update()
        return None

    def delete(self, name: str) -> None:
        self._names.discard(name)
        self._update()


class ReplicaLease:
    """Keeps this replica's key in etcd under a lease, granting a new one whenever it is lost."""

    def __init__(self, client: EtcdClient, layout: KeyLayout, me: str, ttl: int = REPLICA_TTL) -> None:
        self._client = client
        self._key = f"{layout.cluster_prefix}{FOLDER}/{me}"
        self._ttl = ttl
        self._lease = 0

    async def run(self) -> None:
        delay = 0.1
        try:
            while True:
                try:
                    self._lease = await self._client.grant(self._ttl)
                    await self._client.put(self._key, b"", lease=self._lease)
                    delay = 0.1
                    await self._client.keep_alive(self._lease, self._ttl)
                except LeaseLost as exc:
                    log.warning("replica lease lost key=%s error=%s; granting a new one", self._key, exc)
                except EtcdError as exc:
                    log.warning("replica lease failed key=%s error=%s", self._key, exc)
                    await asyncio.sleep(delay)
                    delay = min(RETRY_MAX, delay * 2)
        finally:
            # Shielded: the others should count one replica fewer now, not after the TTL.
            if self._lease:
                try:
                    await asyncio.wait_for(asyncio.shield(self._client.revoke(self._lease)), REVOKE_TIMEOUT)
                except (EtcdError, TimeoutError):
                    log.info("replica lease not revoked key=%s; it expires within %ds", self._key, self._ttl)
