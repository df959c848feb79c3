"""Keys, values and watch events as this package hands them out: frozen dataclasses, so no other module imports
the generated protobuf code."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from vllm_etcd_proxy.fleet.pb import etcd_rpc_pb2 as pb


class EventType(StrEnum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, kw_only=True)
class KeyValue:
    """A key and its value as etcd stores them (bytes: etcd does not require UTF-8)."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True, kw_only=True)
class Event:
    """A watch event; for a DELETE, ``kv`` holds the key and the deletion revision, and an empty value."""

    type: EventType
    kv: KeyValue


@dataclass(frozen=True)
class WatchBatch:
    """One watch response: the ``created`` one and progress notifications have no events.

    ``revision``: every change up to it has been delivered, so a broken watch resumes at ``revision + 1`` (the
    last event's revision, or without events the response header's). In the ``created`` batch it is etcd's
    current revision.
    """

    revision: int
    events: list[Event]
    created: bool = False


def to_bytes(text: str | bytes) -> bytes:
    return text.encode() if isinstance(text, str) else text


def prefix_range(prefix: str | bytes) -> tuple[bytes, bytes]:
    """(key, range_end) that select every key starting with ``prefix``; an empty prefix selects all keys."""
    key = to_bytes(prefix)
    end = bytearray(key)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return key or b"\0", b"\0"  # etcd: range_end "\0" means "to the end of the keyspace"
    end[-1] += 1
    return key, bytes(end)


def key_value(kv: pb.KeyValue) -> KeyValue:
    return KeyValue(
        key=kv.key,
        value=kv.value,
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        version=kv.version,
        lease=kv.lease,
    )
