"""What discovery tells the pool, and what discovery reports about itself.

Discovery turns etcd's list and watch responses into ``PoolEvent``s; the pool only applies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_etcd_proxy.fleet.records import Node


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The complete set of valid etcd nodes at ``revision``: replaces every etcd-sourced node."""

    nodes: tuple[Node, ...]
    revision: int


@dataclass(frozen=True, kw_only=True)
class Upsert:
    """A key was put: add the node or replace the one with the same key."""

    node: Node
    revision: int


@dataclass(frozen=True, kw_only=True)
class Remove:
    """A key was deleted (by hand, by the admin API, or by lease expiry), or now holds an invalid value."""

    key: str
    revision: int


PoolEvent = Snapshot | Upsert | Remove


@dataclass(kw_only=True)
class DiscoveryState:
    """Live state of the etcd watch, read by /status, /ready and /metrics. Written only by discovery."""

    enabled: bool = False
    """False when the proxy runs with static pools only."""
    synced: bool = False
    """True once the first list has been applied; stays true through outages (we serve the last pools)."""
    connected: bool = False
    """True while a watch stream is established."""
    revision: int = 0
    """Revision of the last applied list or watch response."""
    endpoint: str = ""
    """The etcd endpoint currently in use."""
    last_error: str = ""
    """Last etcd error, for operators; empty when healthy."""
    resyncs: int = 0
    """Full re-lists after the first (compaction, revision went backwards, reconnect without resume)."""
    reconnects: int = 0
    """Watch streams re-established after a failure."""
    invalid_records: dict[str, str] = field(default_factory=dict)
    """Keys currently ignored because their value is invalid, with the reason."""
    invalid_total: int = 0
    """Invalid keys or values seen since start (a counter)."""
