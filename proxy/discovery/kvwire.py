"""vLLM's KV-cache event frames, read leniently: what the subscriber (kvsub.py) hands to the index.

A frame is ``[topic, seq (8 bytes, big-endian), payload]``; the payload a msgpack ``EventBatch``, an array
``[ts, events, data_parallel_rank]`` or a map with those names. Each event is a map tagged by ``type`` (vLLM
0.32) or an array whose first item is the tag (older vLLM), with the fields in vLLM's order:
``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...)``,
``BlockRemoved(block_hashes, medium, ...)``, ``AllBlocksCleared()``. Hashes are ints or bytes; bytes are folded
to 60-bit ints (the index keys on token ids, hashes only name blocks within one node). Unknown fields and
unknown event types are ignored; blocks held elsewhere than on the GPU (offloading media) and in a KV-cache
group other than the first (hybrid models) are left out, so each block is counted once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

_DECODER = msgspec.msgpack.Decoder()
_MEDIA = (None, "GPU", "gpu")


class Malformed(ValueError):
    """A frame or event that is not what vLLM sends; the message says how (never its content)."""


class Stored(NamedTuple):
    hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    lora: str
    """The LoRA adapter's name, ``""`` for the base model; ``"#N"`` when only an old ``lora_id`` is given."""


class Removed(NamedTuple):
    hashes: list[int]


class Cleared(NamedTuple):
    pass


Event = Stored | Removed | Cleared


class Batch(NamedTuple):
    seq: int
    ts: float
    events: list[Event]
    bad_events: int
    """Events in the batch that were malformed and left out."""


def read_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise Malformed(f"seq is {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


_FOLD = (1 << 60) - 1
"""Hashes are kept to 60 bits: Python stores such an int in 32 bytes, a 64-bit one in 36 (a block's name within
one node; two of a node's blocks sharing 60 bits is a 1 in 10^12 chance at a million blocks)."""


def _hash(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _FOLD
    if isinstance(value, bytes) and value:
        return int.from_bytes(value[:8], "big") & _FOLD
    raise Malformed("a block hash is neither an int nor bytes")


def _hashes(value: object) -> list[int]:
    if not isinstance(value, list):
        raise Malformed("block_hashes is not a list")
    return [_hash(v) for v in value]


_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED = ("block_hashes", "medium")


def _fields(event: object, names: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """(tag, fields by name) of a map or array event."""
    if isinstance(event, dict):
        tag = event.get("type")
        if not isinstance(tag, str):
            raise Malformed("an event has no type")
        return tag, event
    if isinstance(event, list) and event and isinstance(event[0], str):
        return event[0], dict(zip(names, event[1:], strict=False))
    raise Malformed("an event is neither a map nor a tagged array")


def read_event(event: object) -> Event | None:
    """One event; None for those the index does not use (other types, media, KV-cache groups)."""
    tag = event.get("type") if isinstance(event, dict) else event[0] if isinstance(event, list) and event else None
    if tag == "BlockStored":
        _, f = _fields(event, _STORED)
        if f.get("medium") not in _MEDIA or f.get("group_idx") not in (None, 0):
            return None
        hashes, ids, size = _hashes(f.get("block_hashes")), f.get("token_ids"), f.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise Malformed("block_size is not a positive int")
        if not isinstance(ids, list) or len(ids) != len(hashes) * size:
            raise Malformed("token_ids do not fill the stored blocks")
        parent = f.get("parent_block_hash")
        lora, lora_id = f.get("lora_name"), f.get("lora_id")
        name = lora if isinstance(lora, str) else f"#{lora_id}" if isinstance(lora_id, int) else ""
        return Stored(hashes, None if parent is None else _hash(parent), ids, size, name)
    if tag == "BlockRemoved":
        _, f = _fields(event, _REMOVED)
        if f.get("medium") not in _MEDIA or f.get("group_idx") not in (None, 0):
            return None
        return Removed(_hashes(f.get("block_hashes")))
    if tag == "AllBlocksCleared":
        return Cleared()
    if isinstance(tag, str):
        return None  # a newer vLLM's event: not ours to judge
    raise Malformed("an event is neither a map nor a tagged array")


def read_batch(seq: int, payload: bytes) -> Batch:
    """A frame's payload as a batch; raise ``Malformed`` when it is not one at all."""
    try:
        decoded = _DECODER.decode(payload)
    except (msgspec.DecodeError, ValueError):
        raise Malformed("payload is not msgpack") from None
    if isinstance(decoded, dict):
        ts, events = decoded.get("ts"), decoded.get("events")
    elif isinstance(decoded, list) and len(decoded) >= 2:
        ts, events = decoded[0], decoded[1]
    else:
        raise Malformed("payload is not an event batch")
    if not isinstance(events, list) or not isinstance(ts, int | float):
        raise Malformed("payload is not an event batch")
    found: list[Event] = []
    bad = 0
    for event in events:
        try:
            read = read_event(event)
        except Malformed:
            bad += 1
            continue
        if read is not None:
            found.append(read)
    return Batch(seq=seq, ts=float(ts), events=found, bad_events=bad)
