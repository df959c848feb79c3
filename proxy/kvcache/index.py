"""Which node holds which KV-cache block, from the nodes' own events: one index per replica, keyed on token ids.

vLLM names a block by a hash seeded per process, so two nodes holding the same tokens name them differently.
The index names a block by its own chain of the token ids instead: the key of block ``i`` hashes the key of
block ``i - 1`` (or, for the first, the LoRA adapter's name and the block size) with the block's ``block_size``
token ids, and with the other keys vLLM mixed into that block's hash (its events' ``extra_keys``: the
``cache_salt`` on the first block, media and embedding digests where they are), so one key means one whole
prefix as vLLM would reuse it: two requests with the same tokens and different salts share no key. A request's
prompt is read the same way (``chain``), and its longest cached prefix on a node is the run of its keys that the
node holds.

For each key the index keeps the nodes holding it: a node's slot number while one node does (the common case) or
a bit mask of slots, packed with the key in one word (blocks.py ``Holders``). For each node it keeps its own
hashes -> our keys (blocks.py ``BlockMap``), as a ``BlockRemoved`` names blocks by the node's hashes only. A
block whose parent the node never announced (an event missed before this replica subscribed) cannot be keyed
and is counted as an orphan. Each node holds at most ``MAX_BLOCKS`` blocks here (a real node's cache is
smaller); memory per block: bench/README.md.

The ingest thread changes the index and the request path reads it: each holds ``lock`` while it does (a batch of
events at a time; a routing decision's reads), so a reader never sees a table half rewritten.

Every change costs in proportion to the blocks it names; only dropping a node walks that node's blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vllm_etcd_proxy.proxy.kvcache.blocks import KEY_BITS, MAX_SLOTS, SHARED, BlockMap, Holders
from vllm_etcd_proxy.proxy.kvcache.conversations import Conversations
from vllm_etcd_proxy.proxy.kvcache.wire import Cleared, Event, Removed, Stored

MAX_BLOCKS = 1_000_000
"""Blocks indexed per node at most: 16M tokens at block size 16; stores beyond are counted and left out."""
_MASK = (1 << KEY_BITS) - 1
"""Keys fit 48 bits: with the holder's 16, one packed word (blocks.py)."""


def chain(
    ids: Sequence[int],
    block_size: int,
    lora: str = "",
    blocks: int | None = None,
    salt: str = "",
    after: Sequence[int] = (),
) -> list[int]:
    """The keys of the full blocks of ``ids`` (at most ``blocks`` of them), as the index names them, for a request
    of adapter ``lora`` with ``cache_salt`` ``salt`` ("": none). ``after``: the keys of its first blocks, worked
    out before: only the keys of the blocks after them are returned."""
    key = after[-1] if after else hash((lora, block_size)) & _MASK
    count = len(ids) // block_size if blocks is None else min(blocks, len(ids) // block_size)
    keys = []
    for start in range(len(after) * block_size, count * block_size, block_size):
        key = hash((key, *ids[start : start + block_size])) & _MASK
        if salt and not start:
            key = _with_extra(key, (salt,))
        keys.append(key)
    return keys


def _with_extra(key: int, extra: tuple[object, ...]) -> int:
    """A block's key with the other keys vLLM mixed into its hash."""
    return hash((key, extra)) & _MASK


@dataclass(eq=False)
class NodeBlocks:
    """One node's blocks: its hashes -> our keys, and what its events looked like."""

    slot: int
    blocks: BlockMap = field(default_factory=BlockMap)
    block_size: int = 0
    """Of its last store (0: none yet)."""
    orphans: int = 0
    """Stored blocks left out: their parent was never announced."""
    over: int = 0
    """Stored blocks left out: the node had ``MAX_BLOCKS`` already."""
    version: int = 0
    """Batches of events applied: what a routing decision's memory is checked against (routing/kv_aware.py)."""
    conversations: Conversations = field(default_factory=Conversations)
    """The conversations it serves, by the shape of its stores (conversations.py)."""


class KvIndex:
    """Nodes (by pool entry key) -> blocks, and block keys -> nodes; see the module docstring."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self._max = max_blocks
        self._holders = Holders()
        self.lock = threading.Lock()
        """Held by whoever changes or reads the index (see the module docstring)."""
        self._nodes: dict[str, NodeBlocks] = {}
        self._slots: dict[int, NodeBlocks] = {}
        self._free: list[int] = []
        self._next_slot = 0

    def __len__(self) -> int:
        """Distinct keys indexed."""
        return len(self._holders)

    def node(self, name: str) -> NodeBlocks | None:
        return self._nodes.get(name)

    def slot(self, name: str) -> int | None:
        found = self._nodes.get(name)
        return None if found is None else found.slot

    def slot_of(self, name: str) -> int:
        """The node's slot, given now if it has none yet (a node tracked before its first event)."""
        return self._node(name).slot

    def names(self) -> Iterable[str]:
        return self._nodes.keys()

    def _node(self, name: str) -> NodeBlocks:
        found = self._nodes.get(name)
        if found is None:
            slot = self._free.pop() if self._free else self._next_slot
            if slot >= MAX_SLOTS:
                raise ValueError(f"the index names at most {MAX_SLOTS} nodes")
            self._next_slot = max(self._next_slot, slot + 1)
            found = self._nodes[name] = self._slots[slot] = NodeBlocks(slot=slot)
        return found

    def version(self, slot: int) -> int | None:
        """The ``version`` of the node in ``slot`` (None: no node has it)."""
        found = self._slots.get(slot)
        return None if found is None else found.version

    # -- changes ------------------------------------------------------------------------------------------------

    def apply(self, name: str, events: Iterable[Event], now: float | None = None) -> None:
        """One node's events, in order (``now``: when they came, for the conversation counts)."""
        with self.lock:
            self._apply(name, events, now)

    def _apply(self, name: str, events: Iterable[Event], now: float | None) -> None:
        node = self._node(name)
        node.version += 1
        when = time.monotonic() if now is None else now
        for event in events:
            if isinstance(event, Stored):
                stored = self._stored(node, event)
                if stored is not None:
                    node.conversations.stored(*stored, when)
            elif isinstance(event, Removed):
                self._holders.release_all(node.blocks.pop_all(event.hashes), node.slot)
            elif isinstance(event, Cleared):
                self._clear(node)

    def _stored(self, node: NodeBlocks, event: Stored) -> tuple[int | None, int | None, int] | None:
        """Index the event's blocks; the keys of the block before its first new one (None: the root), of the
        block before its last new one, and of its last new one (None: no block was new)."""
        size, ids, blocks = event.block_size, event.token_ids, node.blocks
        node.block_size = size
        root = None  # the key of the block before the event's first (None: it starts at the root)
        if event.parent is None:
            key = hash((event.lora, size)) & _MASK
        else:
            root = blocks.get(event.parent)
            if root is None:
                node.orphans += len(event.hashes)
                return None
            key = root
        hashes, extra = event.hashes, event.extra
        keys = []
        for i in range(len(hashes)):
            key = hash((key, *ids[i * size : (i + 1) * size])) & _MASK
            if extra is not None and (keys_mixed := extra[i]) is not None:
                key = _with_extra(key, keys_mixed)
            keys.append(key)
        room = self._max - len(blocks)
        if room >= len(hashes):
            added = blocks.add_all(hashes, keys)
        else:
            added = self._add_within(node, hashes, keys, room)
        if not added:
            return None  # stored again (a replayed batch), or no room: already counted
        self._holders.add_all([keys[i] for i in added], node.slot)
        first, last = added[0], added[-1]
        return (keys[first - 1] if first else root), (keys[last - 1] if last else root), keys[last]

    def _add_within(self, node: NodeBlocks, hashes: list[int], keys: list[int], room: int) -> list[int]:
        """``BlockMap.add_all`` for a node near ``MAX_BLOCKS``: the blocks past its room are counted and left
        out."""
        added = []
        for i, engine_hash in enumerate(hashes):
            if room <= 0 and engine_hash not in node.blocks:
                node.over += len(hashes) - i
                break
            if node.blocks.add(engine_hash, keys[i]):
                added.append(i)
                room -= 1
        return added

    def _clear(self, node: NodeBlocks) -> None:
        self._holders.release_all(node.blocks.values(), node.slot)
        node.blocks.clear()
        node.conversations.clear()

    def drop(self, name: str) -> None:
        """Forget a node (gone, restarted, or its events can no longer be trusted); its slot is reused."""
        with self.lock:
            node = self._nodes.pop(name, None)
            if node is not None:
                self._clear(node)
                del self._slots[node.slot]
                self._free.append(node.slot)

    # -- queries ------------------------------------------------------------------------------------------------

    def holders(self, key: int) -> int:
        """Bit mask of the slots holding ``key`` (0: none)."""
        return self._holders.mask(key)

    def depths(
        self, keys: Sequence[int], slots: int, extra: dict[int, int] | None = None, extra_slots: int = -1
    ) -> dict[int, int]:
        """For each slot in the bit mask ``slots`` that holds ``keys[0]``: how many of ``keys`` it holds in a row
        from the first. ``extra``: key -> more slots to count as holding it (blocks sent but not announced), of
        which only those in the mask ``extra_slots`` count."""
        depth: dict[int, int] = {}
        alive = slots
        holders = self._holders
        shards, shift, shared = holders.shards, holders.shift, holders.shared
        for i, key in enumerate(keys):
            table = shards[key >> shift]
            words, size = table.words, table.size
            mask, j = 0, key % size
            while word := words[j]:  # Holders.mask, written out: a call per key would cost ~0.1 us more
                if word >> 16 == key:
                    code = word & SHARED
                    mask = shared.get(key, 0) if code == SHARED else 1 << (code - 1)
                    break
                j += 1
                if j == size:
                    j = 0
            if extra:
                mask |= extra.get(key, 0) & extra_slots
            now = alive & mask
            if now != alive:
                _record(depth, alive & ~now, i)
                alive = now
                if not alive:
                    return depth
        _record(depth, alive, len(keys))
        return depth


def _record(depth: dict[int, int], mask: int, value: int) -> None:
    if not value:
        return
    while mask:
        low = mask & -mask
        depth[low.bit_length() - 1] = value
        mask ^= low
