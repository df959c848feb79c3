"""One leased key in etcd that follows what the runner wants, through etcd outages and lost leases.

A *session* is one lease: grant it, then three tasks until the lease is lost: keep it alive (one stream),
write the key whenever the wanted state changes, and watch the key. A lost lease (etcd unreachable for longer
than the TTL, or the lease revoked or expired) ends the session; the next one starts as soon as etcd grants a
lease again, puts the key back under the new lease and revokes the old lease (best effort: after an etcd
restart the old lease may live on and still hold keys). etcd errors inside a session are retried with capped
back-off, forever: after a successful start the registrar never gives up on etcd.

Operator removal: a key deleted by someone else while our lease is still alive (``etcdctl del``, the proxy's
``/instances/remove``) was removed on purpose. We do not put it back, now or later (not on a health flap, not
after a lost lease): the node stays deregistered, keeps running and keeps its lease, until the registrar is
restarted. A key deleted because its lease expired or was revoked is a lost lease, and comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from google.protobuf import json_format

from vllm_etcd_proxy.fleet.etcd import Compacted, EtcdClient, EtcdError, EtcdUnavailable, EventType, LeaseLost
from vllm_etcd_proxy.fleet.pb.node_record_pb2 import NodeRecord
from vllm_etcd_proxy.fleet.records import InvalidRecord, Status, decode_record, encode_record, set_cards
from vllm_etcd_proxy.fleet.vllm import ModelCard, stable_card

logger = logging.getLogger(__name__)

REVOKE_TIMEOUT = 5.0
"""Seconds the final revoke may take; past that the lease expires on its own within one TTL."""


class Backoff:
    """Capped exponential delays with jitter, so a fleet of registrars does not retry in lockstep."""

    def __init__(self, first: float = 0.2, cap: float = 2.0) -> None:
        self._first, self._cap, self._next = first, cap, first

    def reset(self) -> None:
        self._next = self._first

    def delay(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self._cap)
        return delay * random.uniform(0.5, 1.0)


class Registration:
    """The key ``key`` with ``record`` as value, under a lease of ``ttl`` s, while wanted (see module doc).

    ``start()`` begins; ``set_status``/``set_withdrawn``/``set_models`` change what is wanted (applied in the
    background, ``wait_applied`` waits for it); ``stop()`` ends and revokes the lease, deleting the key.
    """

    def __init__(self, client: EtcdClient, *, key: str, ttl: int, record: NodeRecord) -> None:
        self._client = client
        self._key = key
        self._key_bytes = key.encode()
        self._ttl = ttl
        self._record = NodeRecord()
        self._record.CopyFrom(record)
        self._withdrawn = False
        self._removed = False
        self._lease = 0
        self._stale_leases: list[int] = []
        # True while the key is in etcd because we put it under the current lease; a delete seen while it is
        # True was made by someone else.
        self._present = False
        self._written = b""
        self._write_lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._wanted_version = 0
        self._applied_version = -1
        self._applied = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    @property
    def removed_by_operator(self) -> bool:
        return self._removed

    @property
    def task(self) -> asyncio.Task[None]:
        """The background task; it only ends by ``stop()`` or by a bug, which its exception then shows."""
        assert self._task is not None, "start() first"
        return self._task

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"registration {self._key}")

    async def stop(self) -> None:
        """End the sessions and revoke the lease (which deletes the key); safe to call more than once."""
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.wait([self._task])

    def set_status(self, status: Status) -> None:
        self._record.status = status.value
        self._wanted()

    def set_withdrawn(self, withdrawn: bool) -> None:
        """Withdraw (delete the key, keep the lease) or restore; no effect after an operator removal."""
        self._withdrawn = withdrawn
        self._wanted()

    def set_models(self, models: tuple[str, ...], cards: tuple[ModelCard, ...] = ()) -> None:
        del self._record.models[:]
        self._record.models.extend(models)
        set_cards(self._record, cards)
        self._wanted()

    def cards_changed(self, cards: tuple[ModelCard, ...]) -> bool:
        """True when ``cards`` differ from the model cards in the record, beyond what vLLM makes anew on every
        GET /v1/models (``created``, permission ids): else the record was written again at every poll."""
        written = tuple(stable_card(json_format.MessageToDict(c)) for c in self._record.model_cards)
        return written != tuple(stable_card(dict(c)) for c in cards)

    async def wait_applied(self, timeout: float) -> bool:
        """Wait until etcd holds what is wanted now; False if that took longer than ``timeout`` s."""
        version = self._wanted_version
        try:
            async with asyncio.timeout(timeout), self._applied:
                await self._applied.wait_for(lambda: self._applied_version >= version)
        except TimeoutError:
            return False
        return True

    def _wanted(self) -> None:
        self._wanted_version += 1
        self._changed.set()

    def _want_present(self) -> bool:
        return not self._withdrawn and not self._removed

    # Sessions

    async def _run(self) -> None:
        try:
            await self._sessions()
        finally:
            # Shielded: stop() cancels us, and the revoke must still reach etcd (bounded, though).
            try:
                await asyncio.wait_for(asyncio.shield(self._revoke_all()), REVOKE_TIMEOUT)
            except (EtcdError, TimeoutError) as exc:
                reason = str(exc) or f"etcd unreachable for {REVOKE_TIMEOUT:g}s"
                logger.warning(
                    "lease revoke failed key=%s error=%s; the key expires within ttl=%ds", self._key, reason, self._ttl
                )

    async def _revoke_all(self) -> None:
        """Revoke every lease we hold; retry while etcd is unreachable (the caller bounds the time)."""
        backoff = Backoff()
        for lease in [*self._stale_leases, self._lease]:
            while lease:
                try:
                    await self._client.revoke(lease)
                except EtcdUnavailable:
                    await asyncio.sleep(backoff.delay())
                    continue
                logger.info("lease revoked key=%s lease=%x", self._key, lease)
                break
        self._stale_leases.clear()
        self._lease = 0
        self._present = False

    async def _sessions(self) -> None:
        backoff = Backoff()
        while True:
            try:
                lease = await self._client.grant(self._ttl)
            except EtcdError as exc:
                delay = backoff.delay()
                logger.warning("etcd lease grant failed key=%s retry_in=%.1fs error=%s", self._key, delay, exc)
                await asyncio.sleep(delay)
                continue
            started = asyncio.get_running_loop().time()
            self._lease, self._present, self._written = lease, False, b""
            logger.info("lease granted key=%s lease=%x ttl=%d", self._key, lease, self._ttl)
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._client.keep_alive(lease, self._ttl))
                    group.create_task(self._write_forever(lease))
                    group.create_task(self._watch_forever(lease))
            except* LeaseLost as lost:
                logger.warning(
                    "lease lost key=%s lease=%x error=%s; registering again when etcd answers",
                    self._key,
                    lease,
                    lost.exceptions[0],
                )
            except* EtcdError as failed:
                # Only keep_alive lets these out (the other two retry): a refused keepalive, e.g. lost auth.
                delay = backoff.delay()
                logger.warning(
                    "etcd lease keepalive failed key=%s lease=%x retry_in=%.1fs error=%s",
                    self._key,
                    lease,
                    delay,
                    failed.exceptions[0],
                )
                await asyncio.sleep(delay)
            self._lease, self._present = 0, False
            # Revoked once the next session has put the key; they expire anyway, so a few are enough to remember.
            self._stale_leases = [*self._stale_leases[-7:], lease]
            if asyncio.get_running_loop().time() - started > self._ttl:
                backoff.reset()  # a session that lasted: the next failure starts from a short delay again

    async def _write_forever(self, lease: int) -> None:
        backoff = Backoff()
        while True:
            self._changed.clear()
            version = self._wanted_version
            try:
                await self._write(lease)
                if self._stale_leases:
                    await self._revoke_stale()
            except LeaseLost:
                raise
            except EtcdError as exc:
                delay = backoff.delay()
                logger.warning("etcd write failed key=%s retry_in=%.1fs error=%s", self._key, delay, exc)
                await asyncio.sleep(delay)
                self._changed.set()
                continue
            backoff.reset()
            async with self._applied:
                self._applied_version = max(self._applied_version, version)
                self._applied.notify_all()
            await self._changed.wait()

    async def _write(self, lease: int) -> None:
        async with self._write_lock:
            if self._want_present():
                value = encode_record(self._record)
                if self._present and value == self._written:
                    return
                await self._client.put(self._key, value, lease=lease)
                if not self._present:
                    logger.info("registered key=%s lease=%x status=%s", self._key, lease, self._record.status)
                else:
                    logger.info("record updated key=%s status=%s", self._key, self._record.status)
                self._present, self._written = True, value
            elif self._present:
                await self._client.delete(self._key)
                self._present = False
                logger.info("key deleted key=%s (lease %x kept)", self._key, lease)

    async def _revoke_stale(self) -> None:
        """Revoke leases of earlier sessions, after the key moved to the new lease."""
        for lease in list(self._stale_leases):
            await self._client.revoke(lease)
            self._stale_leases.remove(lease)
            logger.info("old lease revoked key=%s lease=%x", self._key, lease)

    async def _watch_forever(self, lease: int) -> None:
        """Notice deletes of our key we did not make; the write lock orders them against our own writes."""
        backoff = Backoff()
        while True:
            try:
                revision, _ = await self._client.get_prefix(self._key)
                await self._check_still_there(lease)
                async with contextlib.aclosing(self._client.watch_prefix(self._key, revision + 1)) as watch:
                    async for batch in watch:
                        backoff.reset()
                        ours = [e for e in batch.events if e.kv.key == self._key_bytes]
                        for event in ours:
                            if event.type == EventType.PUT:
                                self._adopt(event.kv.value)
                        if any(e.type == EventType.DELETE for e in ours):
                            await self._check_still_there(lease)
            except LeaseLost:
                raise
            except Compacted:
                continue  # missed events: the get_prefix + check above sees the current state
            except EtcdError as exc:
                delay = backoff.delay()
                logger.debug("etcd watch broke key=%s retry_in=%.1fs error=%s", self._key, delay, exc)
                await asyncio.sleep(delay)

    def _adopt(self, value: bytes) -> None:
        """Someone else rewrote our key: the proxy's node operations mark a node for sleep in its record. Keep
        their mark in what we write from now on, so our next write (new models, a status) does not undo it."""
        if not self._present or not value or value == self._written:
            return
        try:
            theirs = decode_record(value)
        except InvalidRecord:
            return
        if theirs.sleep != self._record.sleep:
            logger.info("sleep mark kept key=%s sleep=%s", self._key, theirs.sleep or "awake")
            self._record.sleep = theirs.sleep
        if encode_record(self._record) == value:
            self._written = value  # etcd holds what we want: nothing to write back

    async def _check_still_there(self, lease: int) -> None:
        async with self._write_lock:
            if not self._present or await self._client.get(self._key) is not None:
                return
            if await self._client.time_to_live(lease) <= 0:
                raise LeaseLost(f"key {self._key} deleted with its lease {lease:x}")
            self._removed, self._present = True, False
            logger.warning(
                "key removed by someone else while lease %x is alive (an operator?) key=%s; "
                "staying deregistered until the registrar restarts",
                lease,
                self._key,
            )
