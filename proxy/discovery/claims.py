"""Claims: one replica of the fleet does a piece of work (wake a node of a model, load an adapter) while the
others wait for it, without talking to each other.

A claim is the key ``{prefix}/{cluster}/claims/{name}``, created in one etcd transaction that fails when the key
exists, under a lease of its own that is kept alive while the claim is held: a replica that dies holding one loses
it within ``CLAIM_TTL`` seconds. Its value may carry what the others need to know of the work (``publish``: the
node an adapter was loaded on). Every replica watches the folder (a discovery ``KeySink``) and calls the listeners
of a name's kind (the part before its first ``/``) when a claim is put or goes. Without etcd the claims are this
process's (``LocalClaims``): the same calls, in memory. A replica that cannot reach etcd holds its claims alone
(logged): it may then do the work beside another replica, never not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdError
from vllm_etcd_proxy.fleet.records import KeyLayout

log = logging.getLogger(__name__)

FOLDER = "claims"
CLAIM_TTL = 10
"""Seconds a claim outlives the replica that held it."""
RELEASE_TIMEOUT = 3.0

Listener = Callable[[str, bytes | None], None]
"""(name without its kind, the claim's value; None when it went)."""


class Claim(Protocol):
    """A claim this replica holds: ``publish`` a value for the others, ``release`` when the work is done."""

    async def publish(self, value: bytes) -> None: ...

    async def release(self) -> None: ...


class Claims(Protocol):
    def listen(self, kind: str, listener: Listener) -> None:
        """Call ``listener`` when a claim of ``kind`` is put or goes, whoever held it."""
        ...

    async def take(self, name: str, value: bytes = b"") -> Claim | None:
        """Hold ``name`` (``kind/what``), or None when another holds it."""
        ...


class _Listeners:
    def __init__(self) -> None:
        self._by_kind: dict[str, list[Listener]] = {}

    def listen(self, kind: str, listener: Listener) -> None:
        self._by_kind.setdefault(kind, []).append(listener)

    def tell(self, name: str, value: bytes | None) -> None:
        kind, _, what = name.partition("/")
        for listener in self._by_kind.get(kind, ()):
            listener(what, value)


class LocalClaims:
    """The claims of one process (no etcd, or etcd out of reach)."""

    def __init__(self, listeners: _Listeners | None = None) -> None:
        self._held: set[str] = set()
        self._listeners = listeners if listeners is not None else _Listeners()

    def listen(self, kind: str, listener: Listener) -> None:
        self._listeners.listen(kind, listener)

    async def take(self, name: str, value: bytes = b"") -> Claim | None:
        return self.take_now(name, value)

    def take_now(self, name: str, value: bytes = b"") -> _LocalClaim | None:
        if name in self._held:
            return None
        self._held.add(name)
        self._listeners.tell(name, value)
        return _LocalClaim(self, name)

    def publish(self, name: str, value: bytes) -> None:
        self._listeners.tell(name, value)

    def release(self, name: str) -> None:
        if name in self._held:
            self._held.discard(name)
            self._listeners.tell(name, None)


class _LocalClaim:
    def __init__(self, claims: LocalClaims, name: str) -> None:
        self._claims, self._name = claims, name

    async def publish(self, value: bytes) -> None:
        self._claims.publish(self._name, value)

    async def release(self) -> None:
        self._claims.release(self._name)


class EtcdClaims:
    """Claims in etcd, shared by every replica of the cluster; a ``KeySink`` of the ``claims/`` folder."""

    def __init__(self, client: EtcdClient, layout: KeyLayout, ttl: int = CLAIM_TTL) -> None:
        self.client = client
        self.ttl = ttl
        self._folder = f"{layout.cluster_prefix}{FOLDER}/"
        self._listeners = _Listeners()
        self._alone = LocalClaims(self._listeners)

    def listen(self, kind: str, listener: Listener) -> None:
        self._listeners.listen(kind, listener)

    async def take(self, name: str, value: bytes = b"") -> Claim | None:
        key = self._folder + name
        lease = 0
        try:
            lease = await self.client.grant(self.ttl)
            revision = await self.client.put_if(key, value, mod_revision=0, lease=lease)
        except EtcdError as exc:
            log.warning("claim taken without etcd name=%s error=%s: another replica may do the same", name, exc)
            return self._alone.take_now(name, value)
        if not revision:
            await self.revoke(lease)
            return None
        return _EtcdClaim(self, key, lease, revision)

    async def revoke(self, lease: int) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self.client.revoke(lease)), RELEASE_TIMEOUT)
        except (EtcdError, TimeoutError) as exc:
            log.info("claim lease not revoked lease=%x error=%s; it expires on its own", lease, exc)

    # KeySink: what every replica sees of the folder

    def replace(self, entries: Mapping[str, bytes]) -> Mapping[str, str]:
        for name, value in entries.items():
            self._listeners.tell(name, value)
        return {}

    def put(self, name: str, value: bytes) -> str | None:
        self._listeners.tell(name, value)
        return None

    def delete(self, name: str) -> None:
        self._listeners.tell(name, None)


class _EtcdClaim:
    def __init__(self, claims: EtcdClaims, key: str, lease: int, revision: int) -> None:
        self._claims, self._key, self._lease, self._revision = claims, key, lease, revision
        self._alive = asyncio.create_task(self._keep_alive(), name=f"claim {key}")

    async def _keep_alive(self) -> None:
        try:
            await self._claims.client.keep_alive(self._lease, self._claims.ttl)
        except EtcdError as exc:  # the claim may be lost: the work goes on, another replica may start the same
            log.warning("claim keep-alive failed key=%s error=%s", self._key, exc)

    async def publish(self, value: bytes) -> None:
        client = self._claims.client
        try:
            revision = await client.put_if(self._key, value, mod_revision=self._revision, lease=self._lease)
        except EtcdError as exc:
            log.warning("claim not published key=%s error=%s", self._key, exc)
            return
        if revision:
            self._revision = revision

    async def release(self) -> None:
        self._alive.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._alive
        await self._claims.revoke(self._lease)  # deletes the key: the others hear of it
