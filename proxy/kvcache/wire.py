"""vLLM's KV-cache event frames, read leniently: what the subscriber (subscription.py) hands to the index.

A frame is ``[topic, seq (8 bytes, big-endian), payload]``; the payload a msgpack ``EventBatch``, an array
``[ts, events, data_parallel_rank]`` or a map with those names. Each event is a map tagged by ``type`` (vLLM
0.32) or an array whose first item is the tag (older vLLM), with the fields in vLLM's order:
``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...)``,
``BlockRemoved(block_hashes, medium, ...)``, ``AllBlocksCleared()``. ``extra_keys`` (vLLM 0.32, after
``lora_name``) has one entry per block: None, or the untagged keys vLLM mixed into that block's hash besides its
tokens, in this order: the adapter's name, ``[media id, offset]`` pairs, the ``cache_salt`` (first block only),
prompt-embedding digests. They are kept, the adapter's name left out (it keys the chain already), so that the
index keys a block as vLLM does. Hashes are ints or bytes; bytes are folded to 60-bit ints, ints are passed on
as they came (the index keeps 60 bits of each: it keys on token ids, hashes only name blocks within one node;
blocks.py). Unknown fields and
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
    extra: list[Extra | None] | None = None
    """Per block, the other keys vLLM mixed into its hash (salt, media, embeddings); None when no block has any."""


Extra = tuple[object, ...]
"""A block's extra keys, made hashable: arrays become tuples."""


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
    if all(type(v) is int for v in value):  # vLLM's default: kept as they came (the index folds them again)
        return value
    return [_hash(v) for v in value]


_STORED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
)
_MAX_EXTRA_DEPTH = 4
"""Arrays within arrays an extra key may have (vLLM's deepest is a ``[media id, offset]`` pair in a block's list)."""
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


def _frozen(value: object, depth: int = 0) -> object:
    if isinstance(value, list) and depth < _MAX_EXTRA_DEPTH:
        return tuple(_frozen(v, depth + 1) for v in value)
    if isinstance(value, str | bytes | int | float | bool) or value is None:
        return value
    raise Malformed("an extra key is neither a string, bytes, a number nor an array of them")


def _extra(value: object, blocks: int, lora: str) -> list[Extra | None] | None:
    """``extra_keys``, one entry per block, without the adapter's name that leads each entry of an adapter's
    blocks; None when no block has another key (the common case costs one pass over short lists)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != blocks:
        raise Malformed("extra_keys is not one entry per block")
    if value.count(None) == blocks:  # vLLM's own when nothing else was mixed in: one pass in C
        return None
    found: list[Extra | None] = []
    others = False
    for entry in value:
        if entry is None:
            found.append(None)
            continue
        if not isinstance(entry, list):
            raise Malformed("an extra_keys entry is neither null nor an array")
        keys = entry[1:] if lora and entry and entry[0] == lora else entry
        frozen = tuple(_frozen(key, 1) for key in keys)
        found.append(frozen or None)
        others = others or bool(frozen)
    return found if others else None


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
        extra = _extra(f.get("extra_keys"), len(hashes), lora if isinstance(lora, str) else "")
        return Stored(hashes, None if parent is None else _hash(parent), ids, size, name, extra)
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
