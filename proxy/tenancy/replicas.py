"""The replicas that share the fleet's limits, and what each holds of them: each replica puts
``{prefix}/{cluster}/replicas/{id}`` under a lease of its own, its value its record (record.py), put again at most
once a second and only when it changed; every replica watches that folder (a discovery sink), itself included.

A replica that dies stops refreshing its lease: its key leaves the view within the TTL, and what it held stays held
until it would have refilled (``ReplicaView.reserved``), then is the others' again. One that is cut off from etcd
keeps the view it last saw while its holdings decay towards an even part (shares.py); once it learns its lease
was lost it gives up what it held (the others took it back). Without etcd the count is the replica's
``--workers`` (each worker is a replica of its own) and there are no records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdError, LeaseLost
from vllm_etcd_proxy.fleet.records import KeyLayout
from vllm_etcd_proxy.proxy.tenancy.record import WINDOW, Entry, InvalidRecord, Record, decode

log = logging.getLogger(__name__)

FOLDER = "replicas"
REPLICA_TTL = 10
"""Seconds a dead replica's key outlives it: the longest time its demand still counts."""
PUBLISH_INTERVAL = 1.0
"""Seconds between two puts of this replica's record, at least."""
REVOKE_TIMEOUT = 3.0
RETRY_MAX = 2.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Reservation:
    """What a replica that left held of one limit, until ``heir`` takes it or ``until`` (it would have refilled)."""

    replica: str
    cap: float
    until: float
    heir: str


def replica_id() -> str:
    """Unique per process (every worker of ``--workers`` enforces its own share)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ReplicaView:
    """The live replicas and their records, from the ``replicas/`` folder (a ``KeySink``). ``count`` is at least
    ``least``; ``version`` changes with every change. ``on_change`` is called with the replica whose record was put
    or deleted (None after a re-list). What a replica that left held is kept as held (``reserved``) until it would
    have refilled: it may have spent it, and the others must not hand it out as unspent."""

    def __init__(
        self,
        me: str,
        on_count: Callable[[int], None] | None = None,
        *,
        least: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.me = me
        self.clock = clock
        """The time every part of the shares reads (a test's own clock)."""
        self._records: dict[str, Record] = {}
        self._reserved: dict[tuple[str, str], list[Reservation]] = {}
        """What replicas that left held, by (tenant, kind)."""
        self._least = least
        self.count = least
        self.version = 0
        self._on_count = on_count
        self.on_change: Callable[[str | None], None] = lambda replica: None
        if on_count is not None:
            on_count(least)

    def members(self) -> list[str]:
        """The replicas seen, this one included, in one order every replica agrees on."""
        return sorted(self._records.keys() | {self.me})

    def record(self, replica: str) -> Record:
        """What ``replica`` last published (nothing when it did not)."""
        return self._records.get(replica, _EMPTY)

    def entry(self, replica: str, tenant: str, kind: str) -> Entry | None:
        return self._records.get(replica, _EMPTY).get(tenant, _NONE).get(kind)

    def seen(self, replica: str) -> bool:
        return replica in self._records

    def tenants(self) -> set[str]:
        """Every tenant some replica published."""
        return {tenant for record in self._records.values() for tenant in record}

    def reserved(self, tenant: str, kind: str, now: float) -> float:
        """What replicas that left held of ``tenant``'s ``kind`` limit that no live replica holds yet: until their
        heir's record says it took it, or until it would have refilled."""
        held = self._reserved.get((tenant, kind))
        if not held:
            return 0.0
        held[:] = [r for r in held if r.until > now and not self._inherited(r, tenant, kind)]
        return math.fsum(r.cap for r in held)

    def _inherited(self, reservation: Reservation, tenant: str, kind: str) -> bool:
        entry = self.entry(reservation.heir, tenant, kind)
        return entry is not None and reservation.replica in entry.heir_of

    def bequest(self, replica: str) -> list[tuple[str, str, float]]:
        """What ``replica``, which left, held and this replica is the heir of: (tenant, kind, cap)."""
        out: list[tuple[str, str, float]] = []
        for (tenant, kind), held in self._reserved.items():
            out.extend((tenant, kind, r.cap) for r in held if r.replica == replica and r.heir == self.me)
        return out

    def _changed(self) -> None:
        self.version += 1
        count = max(self._least, len(self._records.keys() | {self.me}))
        if count != self.count:
            log.info("replicas sharing the limits: %d", count)
            if self._on_count is not None:
                self._on_count(count)
        self.count = count

    def _read(self, name: str, value: bytes) -> str | None:
        """Store ``name``'s record; the reason when it is invalid (the replica then counts, holding nothing)."""
        try:
            self._records[name] = decode(value)
        except InvalidRecord as exc:
            self._records[name] = {}
            return str(exc)
        return None

    def _left(self, name: str) -> None:
        """``name``'s key is gone: what it held, and what was handed to it or by it unacknowledged, goes to its heir
        (the first live replica in the order all agree on), as spent; the others count it as held until then."""
        record = self._records.pop(name, None) or {}
        now = self.clock()
        held: dict[tuple[str, str], float] = {}
        fills: dict[tuple[str, str], float] = {}
        for tenant, kinds in record.items():
            for kind, entry in kinds.items():
                unacknowledged = (t for taker, t in entry.to.items() if self._got(taker, tenant, kind, name) < t.seq)
                held[(tenant, kind)] = entry.cap + math.fsum(t.cap for t in unacknowledged)
                fills[(tenant, kind)] = max(0.0, min(1.0, entry.fill))
        for giver, others in self._records.items():
            for tenant, kinds in others.items():
                for kind, entry in kinds.items():
                    sent = entry.to.get(name)
                    taker = record.get(tenant, {}).get(kind)
                    if sent is not None and (taker.got.get(giver, 0) if taker else 0) < sent.seq:
                        held[(tenant, kind)] = held.get((tenant, kind), 0.0) + sent.cap
        heir = self.members()[0]
        for (tenant, kind), cap in held.items():
            refill = REPLICA_TTL if kind == "concurrency" else WINDOW * (1 - fills.get((tenant, kind), 0.0))
            reservation = Reservation(replica=name, cap=cap, until=now + refill, heir=heir)
            self._reserved.setdefault((tenant, kind), []).append(reservation)

    def _got(self, taker: str, tenant: str, kind: str, giver: str) -> int:
        """The last of ``giver``'s hand-overs that ``taker``'s record acknowledges (0: none)."""
        entry = self.entry(taker, tenant, kind)
        return entry.got.get(giver, 0) if entry is not None else 0

    def replace(self, entries: Mapping[str, bytes]) -> Mapping[str, str]:
        for name in list(self._records.keys() - entries.keys()):
            self._left(name)
        invalid = {name: reason for name, value in entries.items() if (reason := self._read(name, value))}
        self._changed()
        self.on_change(None)
        return invalid

    def put(self, name: str, value: bytes) -> str | None:
        reason = self._read(name, value)
        self._changed()
        self.on_change(name)
        return reason

    def delete(self, name: str) -> None:
        self._left(name)
        self._changed()
        self.on_change(name)


_EMPTY: Record = {}
_NONE: dict[str, Entry] = {}


class ReplicaLease:
    """Keeps this replica's key in etcd under a lease, granting a new one whenever it is lost, and puts the
    replica's record (``record()``) in it: at most once every ``PUBLISH_INTERVAL`` s, only when it changed, and
    at once when ``wake`` is set (a tenant this replica did not publish asked something) and the last put is a
    second old. ``on_refresh`` is called at every refresh of the lease (the shares' sign that etcd is there),
    ``on_lost`` when the lease was lost (its key, and so what the record held, is the others' now)."""

    def __init__(
        self,
        client: EtcdClient,
        layout: KeyLayout,
        me: str,
        record: Callable[[], bytes],
        *,
        wake: asyncio.Event,
        on_refresh: Callable[[], None],
        on_lost: Callable[[], None] = lambda: None,
        ttl: int = REPLICA_TTL,
    ) -> None:
        self._client = client
        self._key = f"{layout.cluster_prefix}{FOLDER}/{me}"
        self._record = record
        self._wake = wake
        self._on_refresh = on_refresh
        self._on_lost = on_lost
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
                    self._on_lost()
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
