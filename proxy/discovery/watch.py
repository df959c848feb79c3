"""List, then watch from the next revision; re-list only when the watch cannot resume.

Three layers, as in kopf's watching: ``run`` is a forever loop with capped, jittered back-off;
``_list`` and ``_watch`` turn etcd's answers into ``PoolEvent``s; ``EtcdClient.watch_prefix`` reads one
response at a time under an inactivity timeout (``dead_after``: the stream asks etcd for progress, so
silence means a dead connection, e.g. a silent partition). A broken stream resumes from the last revision + 1 without
re-listing; a compaction, or an etcd whose revision went backwards (lost or restored data), forces a re-list
whose ``Snapshot`` replaces the pool and so applies the deletes the watch missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from vllm_etcd_proxy.fleet.etcd import Compacted, EtcdClient, EtcdError, EventType, KeyValue, WatchBatch
from vllm_etcd_proxy.fleet.records import InvalidRecord, KeyLayout, Node
from vllm_etcd_proxy.proxy.discovery.events import DiscoveryState, PoolEvent, Remove, Snapshot, Upsert

log = logging.getLogger(__name__)

BACKOFF_START = 0.1
"""Seconds before the first retry; doubles up to ``backoff_max``."""
BACKOFF_MAX = 2.0
"""Longest pause between attempts. It counts from the start of the failed attempt, so an attempt that timed out
after ``dead_after`` s is retried at once: after a partition heals the watch is back within ``dead_after`` s."""


class KeySink(Protocol):
    """Takes the keys of one folder under the cluster prefix that are not nodes (``adapters/``, ``keys/``, ...).

    ``name`` is the rest of the key after ``{cluster_prefix}{folder}/``. A value the sink cannot use is answered
    with the reason, which discovery logs and counts as it does an invalid node record."""

    def replace(self, entries: Mapping[str, bytes]) -> Mapping[str, str]:
        """Every entry of the folder after a (re-)list; returns name -> reason for the invalid ones."""
        ...

    def put(self, name: str, value: bytes) -> str | None:
        """One key was put; None when valid, else the reason it is ignored."""
        ...

    def delete(self, name: str) -> None:
        """One key was deleted (by hand or by lease expiry)."""
        ...


class _Relist(Exception):
    """The watch cannot resume: list again."""


class _Claims:
    """Which key owns each node id. A node id registered under two roles (two keys) is ambiguous: the key
    written first keeps it, later ones are shadowed (ignored as invalid) and take over when it goes away."""

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}
        self._node_of: dict[str, str] = {}
        self._shadowed: dict[str, Node] = {}

    def claim(self, key: str, node: Node) -> str | None:
        """None when ``key`` may serve ``node``; else the key that already owns its node id."""
        owner = self._owner.setdefault(node.node_id, key)
        if owner == key:
            self._node_of[key] = node.node_id
            self._shadowed.pop(key, None)
            return None
        self._shadowed[key] = node
        return owner

    def release(self, key: str) -> Node | None:
        """Forget ``key``; when it owned a node id, hand it to the oldest shadowed key and return that node."""
        self._shadowed.pop(key, None)
        node_id = self._node_of.pop(key, None)
        if node_id is None or self._owner.get(node_id) != key:
            return None
        del self._owner[node_id]
        for other, node in self._shadowed.items():
            if node.node_id == node_id:
                self.claim(other, node)
                return node
        return None


class Discovery:
    """Keeps the pool in step with ``layout.cluster_prefix`` in etcd by calling ``apply`` with pool events, once
    per etcd response (a burst of registrations arrives as a few responses of many events each)."""

    def __init__(
        self,
        client: EtcdClient,
        layout: KeyLayout,
        apply: Callable[[Sequence[PoolEvent]], None],
        state: DiscoveryState,
        *,
        sinks: Mapping[str, KeySink] | None = None,
        backoff_max: float = BACKOFF_MAX,
    ) -> None:
        self._client = client
        self._layout = layout
        self._apply = apply
        self._state = state
        self._backoff_max = backoff_max
        self._listed = False
        self._broken = False
        self._claims = _Claims()
        self._failures = 0
        self._sinks = dict(sinks or {})

    async def run(self) -> None:
        """Watch until cancelled; etcd errors only delay the next attempt."""
        state = self._state
        state.enabled = True
        relist = True
        while True:
            started = asyncio.get_running_loop().time()
            try:
                if relist:
                    await self._list()
                    relist = False
                await self._watch()
            except (_Relist, Compacted) as exc:
                if isinstance(exc, Compacted):
                    log.info(
                        "etcd compacted past the watch; re-listing revision=%d compact_revision=%d",
                        state.revision,
                        exc.compact_revision,
                    )
                relist, state.connected = True, False
                state.resyncs += 1
                continue
            except EtcdError as exc:
                state.last_error = str(exc)
                log.warning("etcd watch failed endpoint=%s error=%s", self._client.current_endpoint, exc)
            except Exception as exc:  # noqa: BLE001 - a bug in apply() must not end discovery for good
                state.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("discovery failed; re-listing after back-off")
                relist = True
            state.connected = False
            self._broken = True
            self._failures += 1
            delay = min(self._backoff_max, BACKOFF_START * 2 ** (self._failures - 1))
            elapsed = asyncio.get_running_loop().time() - started
            await asyncio.sleep(max(0.0, random.uniform(delay / 2, delay) - elapsed))

    async def _list(self) -> None:
        state = self._state
        revision, kvs = await self._client.get_prefix(self._layout.cluster_prefix)
        nodes, invalid = list[Node](), dict[str, str]()
        folders: dict[str, dict[str, bytes]] = {folder: {} for folder in self._sinks}
        self._claims = _Claims()
        for kv in sorted(kvs, key=lambda kv: kv.create_revision):
            key = kv.key.decode("utf-8", "replace")
            if (target := self._folder(key)) is not None:
                folders[target[0]][target[1]] = kv.value
                continue
            parsed = self._parse(kv)
            if isinstance(parsed, Node) and (owner := self._claims.claim(key, parsed)) is not None:
                parsed = _duplicate(parsed, owner)
            if isinstance(parsed, Node):
                nodes.append(parsed)
            else:
                invalid[key] = parsed
        for folder, entries in folders.items():
            for name, reason in self._sinks[folder].replace(entries).items():
                invalid[self._sink_key(folder, name)] = reason
        for key, reason in invalid.items():
            if state.invalid_records.get(key) != reason:
                state.invalid_total += 1
                log.warning("ignoring invalid etcd record key=%r reason=%s", key, reason)
        state.invalid_records = invalid
        self._apply([Snapshot(nodes=tuple(nodes), revision=revision)])
        state.revision, state.synced, state.endpoint = revision, True, self._client.current_endpoint
        log.info(
            "etcd listed prefix=%s nodes=%d invalid=%d revision=%d endpoint=%s resync=%s",
            self._layout.cluster_prefix,
            len(nodes),
            len(invalid),
            revision,
            state.endpoint,
            self._listed,
        )
        self._listed = True

    async def _watch(self) -> None:
        """Apply watch batches from ``state.revision + 1``; return only by raising."""
        start = self._state.revision + 1
        async with contextlib.aclosing(self._client.watch_prefix(self._layout.cluster_prefix, start)) as watch:
            async for batch in watch:
                self._handle(batch, start)

    def _handle(self, batch: WatchBatch, start: int) -> None:
        state = self._state
        if batch.created:
            if batch.revision < state.revision:
                log.warning(
                    "etcd revision went backwards; re-listing revision=%d last_seen=%d endpoint=%s",
                    batch.revision,
                    state.revision,
                    self._client.current_endpoint,
                )
                raise _Relist
            if self._broken:
                state.reconnects += 1
            self._broken, self._failures = False, 0
            state.connected, state.last_error = True, ""
            state.endpoint = self._client.current_endpoint
            log.info(
                "etcd watching prefix=%s from_revision=%d endpoint=%s",
                self._layout.cluster_prefix,
                start,
                state.endpoint,
            )
            return
        out: list[PoolEvent] = []
        for event in batch.events:
            self._apply_event(event.type, event.kv, out)
        if out:
            self._apply(out)
        state.revision = max(state.revision, batch.revision)

    def _apply_event(self, kind: EventType, kv: KeyValue, out: list[PoolEvent]) -> None:
        state = self._state
        key = kv.key.decode("utf-8", "replace")  # a non-UTF-8 key is never a node; parse() says so
        if (target := self._folder(key)) is not None:
            self._sink_event(kind, key, target, kv.value)
            return
        if kind is EventType.DELETE:
            state.invalid_records.pop(key, None)
            out.append(Remove(key=key, revision=kv.mod_revision))
            self._promote(key, kv.mod_revision, out)
            return
        parsed = self._parse(kv)
        shadowed = False
        if isinstance(parsed, Node) and (owner := self._claims.claim(key, parsed)) is not None:
            parsed, shadowed = _duplicate(parsed, owner), True
        if isinstance(parsed, Node):
            state.invalid_records.pop(key, None)
            out.append(Upsert(node=parsed, revision=kv.mod_revision))
            return
        state.invalid_total += 1
        state.invalid_records[key] = parsed
        log.warning("ignoring invalid etcd record key=%r reason=%s", key, parsed)
        # A key that held a valid node and now holds garbage must not keep routing to the old node.
        out.append(Remove(key=key, revision=kv.mod_revision))
        if not shadowed:
            self._promote(key, kv.mod_revision, out)

    def _promote(self, key: str, revision: int, out: list[PoolEvent]) -> None:
        """``key`` no longer serves its node id: a shadowed key with the same id takes over."""
        heir = self._claims.release(key)
        if heir is not None and heir.key is not None:
            self._state.invalid_records.pop(heir.key, None)
            log.info("node id now served by key=%r", heir.key)
            out.append(Upsert(node=heir, revision=revision))

    def _folder(self, key: str) -> tuple[str, str] | None:
        """(folder, name) when ``key`` belongs to a sink's folder, else None (a node key, or garbage)."""
        if not self._sinks:
            return None
        folder, sep, name = key[len(self._layout.cluster_prefix) :].partition("/")
        if sep and name and folder in self._sinks and key.startswith(self._layout.cluster_prefix):
            return folder, name
        return None

    def _sink_key(self, folder: str, name: str) -> str:
        return f"{self._layout.cluster_prefix}{folder}/{name}"

    def _sink_event(self, kind: EventType, key: str, target: tuple[str, str], value: bytes) -> None:
        state, sink = self._state, self._sinks[target[0]]
        if kind is EventType.DELETE:
            state.invalid_records.pop(key, None)
            sink.delete(target[1])
            return
        reason = sink.put(target[1], value)
        if reason is None:
            state.invalid_records.pop(key, None)
            return
        state.invalid_total += 1
        state.invalid_records[key] = reason
        log.warning("ignoring invalid etcd record key=%r reason=%s", key, reason)

    def _parse(self, kv: KeyValue) -> Node | str:
        """The node, or why the key/value is not one."""
        try:
            return self._layout.parse(kv.key, kv.value)
        except InvalidRecord as exc:
            return str(exc)


def _duplicate(node: Node, owner: str) -> str:
    return f"node id {node.node_id!r} is already registered under {owner!r}"
