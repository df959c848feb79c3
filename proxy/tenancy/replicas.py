"""The replicas that share the fleet's limits, and what each says its tenants asked of it: each replica puts
``{prefix}/{cluster}/replicas/{id}`` under a lease of its own, its value the record of its tenants' demand
(demand.py), put again at most once a second and only when it changed; every replica watches that folder (a
discovery sink), itself included, and so computes the same split of every limit (shares.py).

A replica that dies stops refreshing its lease: its key, and with it its demand, leaves the view within the TTL.
One that is cut off from etcd keeps the view it last saw while its shares decay (shares.py), and its key expires
for the others, who then split the limits among themselves. Without etcd the count is the replica's ``--workers``
(each worker is a replica of its own) and there are no records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping

from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdError, LeaseLost
from vllm_etcd_proxy.fleet.records import KeyLayout
from vllm_etcd_proxy.proxy.tenancy.demand import NO_REPORT, InvalidRecord, TenantReport, decode

log = logging.getLogger(__name__)

FOLDER = "replicas"
REPLICA_TTL = 10
"""Seconds a dead replica's key outlives it: the longest time its demand still counts."""
PUBLISH_INTERVAL = 1.0
"""Seconds between two puts of this replica's record, at least."""
QUIET_MARGIN = 0.25
"""Seconds a put takes to be watched by the other replicas, at most (on a healthy etcd: milliseconds)."""
REVOKE_TIMEOUT = 3.0
RETRY_MAX = 2.0


def replica_id() -> str:
    """Unique per process (every worker of ``--workers`` enforces its own share)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ReplicaView:
    """The live replicas and their records, from the ``replicas/`` folder (a ``KeySink``). ``count`` is at least
    ``least``; ``version`` changes with every change, so that shares computed from the view can be cached."""

    def __init__(self, me: str, on_count: Callable[[int], None] | None = None, *, least: int = 1) -> None:
        self.me = me
        self._records: dict[str, dict[str, TenantReport]] = {}
        self._arrived: dict[str, float] = {}
        self._least = least
        self.count = least
        self.version = 0
        self._on_count = on_count
        if on_count is not None:
            on_count(least)

    def members(self) -> list[str]:
        """The replicas seen, this one included, in one order every replica agrees on."""
        return sorted(self._records.keys() | {self.me})

    def report(self, replica: str, tenant: str) -> TenantReport:
        """What ``replica`` last published about ``tenant`` (nothing asked when it did not)."""
        record = self._records.get(replica)
        return record.get(tenant, NO_REPORT) if record is not None else NO_REPORT

    def seen(self, replica: str) -> bool:
        return replica in self._records

    def quiet(self, replica: str, tenant: str, now: float) -> bool:
        """Whether ``replica`` can hold nothing of ``tenant`` that it did not publish: it left, or its record has
        no entry for the tenant and came more than a publish's interval ago (a replica that sees a tenant it
        does not publish publishes at once unless it did less than ``PUBLISH_INTERVAL`` s before)."""
        if replica not in self._records:
            return True
        old = now - self._arrived.get(replica, now) > PUBLISH_INTERVAL + QUIET_MARGIN
        return old and tenant not in self._records[replica]

    def tenants(self) -> set[str]:
        """Every tenant some replica published."""
        return {tenant for record in self._records.values() for tenant in record}

    def _changed(self) -> None:
        self.version += 1
        count = max(self._least, len(self._records.keys() | {self.me}))
        if count != self.count:
            log.info("replicas sharing the limits: %d", count)
            if self._on_count is not None:
                self._on_count(count)
        self.count = count

    def _read(self, name: str, value: bytes) -> str | None:
        """Store ``name``'s record; the reason when it is invalid (the replica then counts with no demand)."""
        self._arrived[name] = time.monotonic()
        try:
            self._records[name] = decode(value)
        except InvalidRecord as exc:
            self._records[name] = {}
            return str(exc)
        return None

    def replace(self, entries: Mapping[str, bytes]) -> Mapping[str, str]:
        self._records, self._arrived = {}, {}
        invalid = {name: reason for name, value in entries.items() if (reason := self._read(name, value))}
        self._changed()
        return invalid

    def put(self, name: str, value: bytes) -> str | None:
        reason = self._read(name, value)
        self._changed()
        return reason

    def delete(self, name: str) -> None:
        self._records.pop(name, None)
        self._arrived.pop(name, None)
        self._changed()


class ReplicaLease:
    """Keeps this replica's key in etcd under a lease, granting a new one whenever it is lost, and puts the
    replica's record (``record()``) in it: at most once every ``PUBLISH_INTERVAL`` s, only when it changed, and
    at once when ``wake`` is set (a tenant this replica did not publish asked something) and the last put is a
    second old. ``on_refresh`` is called at every refresh of the lease (the shares' sign that etcd is there)."""

    def __init__(
        self,
        client: EtcdClient,
        layout: KeyLayout,
        me: str,
        record: Callable[[], bytes],
        *,
        wake: asyncio.Event,
        on_refresh: Callable[[], None],
        ttl: int = REPLICA_TTL,
    ) -> None:
        self._client = client
        self._key = f"{layout.cluster_prefix}{FOLDER}/{me}"
        self._record = record
        self._wake = wake
        self._on_refresh = on_refresh
        self._ttl = ttl
        self._lease = 0
        self._published: bytes | None = None

    async def run(self) -> None:
        delay = 0.1
        try:
            while True:
                try:
                    self._lease = await self._client.grant(self._ttl)
                    self._published = self._record()
                    await self._client.put(self._key, self._published, lease=self._lease)
                    delay = 0.1
                    await self._keep(self._lease)
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

    async def _keep(self, lease: int) -> None:
        """Refresh the lease and publish under it until one of them ends (the lease lost, or a bug)."""
        keep = asyncio.create_task(self._client.keep_alive(lease, self._ttl, lambda ttl: self._on_refresh()))
        publish = asyncio.create_task(self._publish(lease))
        try:
            done, _ = await asyncio.wait((keep, publish), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in (keep, publish):
                task.cancel()
            for task in (keep, publish):
                with contextlib.suppress(asyncio.CancelledError, EtcdError):
                    await task

    async def _publish(self, lease: int) -> None:
        put_at = time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), PUBLISH_INTERVAL)
            await asyncio.sleep(max(0.0, put_at + PUBLISH_INTERVAL - time.monotonic()))
            self._wake.clear()
            value = self._record()
            if value == self._published:
                continue
            try:
                await self._client.put(self._key, value, lease=lease)
            except EtcdError as exc:
                log.warning("replica record not published key=%s error=%s; retrying in a second", self._key, exc)
            else:
                self._published = value
            put_at = time.monotonic()
