"""The index's two maps, packed into arrays of 64-bit ints: a node's engine hashes -> keys (``BlockMap``), and
block keys -> the nodes holding them (``Holders``).

A dict of Python ints costs a block two int objects (32 bytes each) and an entry (24 bytes, plus its share of
the table's empty room); here a block is one 8-byte word in ``Holders`` (its 48-bit key and, in the low 16 bits,
its holder) and two in its node's ``BlockMap``, with no object of its own. Open addressing with linear probing,
at a load of 0.43-0.65: a table grows by half when it passes 0.65, so it never sits much emptier than that (a
doubling table sits at 0.33-0.65, which would cost a fifth more), and its runs stay short (at 0.8 a miss walked
13 entries on average, at 0.65 five). A removal shifts the entries after it back (no tombstones). Past
``SPLIT_AT`` entries a map splits into tables by the top bits of what it is keyed by, each growing on its own:
growing copies a table in Python (~0.25 us an entry), and one table of a million entries would hold the ingest
for a quarter of a second.

Each store or removal is ~0.5-1 us of Python where a dict's was ~0.1-0.2, so the index changes the maps an
event at a time (``add_all``, ``pop_all``, ``release_all``: one call and one look-up of the tables per event, the
probe written out in each); routing's lookups read ``Holders`` (index.py walks its words itself, to save a call
per key). Engine hashes are kept to 60 bits (``BlockMap`` folds them), stored plus one so that 0 means empty;
keys below 2^48 (index.py folds them).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence

_MIN = 16
HASH_BITS = 60
_FOLD = (1 << HASH_BITS) - 1
KEY_BITS = 48
"""Bits of a block key: with a 16-bit holder they fill one word (a false match of two prefixes' keys is a 1 in
10^7 chance at 5,000,000 keys: it could only make one request look cached where it is not)."""
SHARED = 0xFFFF
"""A holder code meaning "several nodes": their bit mask is kept apart, in ``Holders.shared``."""
MAX_SLOTS = SHARED - 1
"""Nodes a ``Holders`` table can name (a slot is stored plus one)."""
SPLIT_AT = 8192
"""Entries past which a map splits into shards."""
SHARD_BITS = 6
"""A node's map splits into 64 tables: a million blocks on one node grow 16,000 at a time."""
HOLDER_SHARD_BITS = 8
"""The holders split into 256: 5,000,000 keys grow 20,000 at a time."""


def _over(used: int, size: int) -> bool:
    return used * 20 > size * 13


def _grown(size: int) -> int:
    return size + size // 2


def _empty(size: int) -> array[int]:
    return array("Q", bytes(8 * size))


class _Pairs:
    """One table of (stored hash, key) pairs."""

    __slots__ = ("hashes", "keys", "size", "used")

    def __init__(self, size: int = _MIN) -> None:
        self.hashes, self.keys, self.size, self.used = _empty(size), _empty(size), size, 0

    def put(self, stored: int, key: int) -> None:
        """Place a pair known to be absent, with room for it."""
        hashes, size = self.hashes, self.size
        i = (stored - 1) % size
        while hashes[i]:
            i += 1
            if i == size:
                i = 0
        hashes[i], self.keys[i] = stored, key
        self.used += 1

    def vacate(self, i: int) -> None:
        """Empty entry ``i``: the entries after it in its run move back unless their home slot lies in (i, j]."""
        hashes, keys, size = self.hashes, self.keys, self.size
        j = i
        while True:
            j += 1
            if j == size:
                j = 0
            found = hashes[j]
            if not found:
                break
            home = (found - 1) % size
            if (i < home <= j) if i <= j else (home > i or home <= j):
                continue
            hashes[i], keys[i] = found, keys[j]
            i = j
        hashes[i] = keys[i] = 0
        self.used -= 1

    def grow(self) -> None:
        old = zip(self.hashes, self.keys, strict=True)
        self.__init__(_grown(self.size))  # type: ignore[misc]
        for stored, key in old:
            if stored:
                self.put(stored, key)


class BlockMap:
    """A dict from 60-bit engine hashes to 48-bit keys, for the methods the index uses."""

    __slots__ = ("_shards", "_shift", "_used")

    def __init__(self) -> None:
        self._shards, self._shift, self._used = [_Pairs()], HASH_BITS, 0
        """One table (``h >> 60`` is 0) until ``SPLIT_AT`` entries, then 64 by a hash's top bits."""

    def __len__(self) -> int:
        return self._used

    def get(self, engine_hash: int) -> int | None:
        h = engine_hash & _FOLD
        table = self._shards[h >> self._shift]
        hashes, size, stored = table.hashes, table.size, h + 1
        i = h % size
        while True:  # the probe, written out in get, add and pop: a call more would cost every block ~0.1 us
            found = hashes[i]
            if found == stored:
                return table.keys[i]
            if not found:
                return None
            i += 1
            if i == size:
                i = 0

    def __contains__(self, engine_hash: int) -> bool:
        return self.get(engine_hash) is not None

    def add(self, engine_hash: int, key: int) -> bool:
        """Map ``engine_hash`` to ``key`` unless it is mapped already; whether it was added."""
        return bool(self.add_all([engine_hash], [key]))

    def add_all(self, engine_hashes: Sequence[int], keys: Sequence[int]) -> list[int]:
        """Map each of ``engine_hashes`` to the key at the same place unless it is mapped already; the places of
        those added."""
        added = []
        shards, shift = self._shards, self._shift
        for n, engine_hash in enumerate(engine_hashes):
            h = engine_hash & _FOLD
            table = shards[h >> shift]
            hashes, size, stored = table.hashes, table.size, h + 1
            i = h % size
            while found := hashes[i]:
                if found == stored:
                    break
                i += 1
                if i == size:
                    i = 0
            else:
                hashes[i], table.keys[i] = stored, keys[n]
                table.used += 1
                added.append(n)
                if _over(table.used, size):
                    table.grow()
        self._used += len(added)
        if self._used > SPLIT_AT and self._shift == HASH_BITS:
            self._split()
        return added

    def pop(self, engine_hash: int) -> int | None:
        """Unmap ``engine_hash``; its key (None: it was not mapped)."""
        found = self.pop_all([engine_hash])
        return found[0] if found else None

    def pop_all(self, engine_hashes: Iterable[int]) -> list[int]:
        """Unmap each of ``engine_hashes``; the keys of those that were mapped."""
        gone = []
        shards, shift = self._shards, self._shift
        for engine_hash in engine_hashes:
            h = engine_hash & _FOLD
            table = shards[h >> shift]
            hashes, size, stored = table.hashes, table.size, h + 1
            i = h % size
            while found := hashes[i]:
                if found == stored:
                    break
                i += 1
                if i == size:
                    i = 0
            else:
                continue
            gone.append(table.keys[i])
            table.vacate(i)
        self._used -= len(gone)
        return gone

    def values(self) -> Iterator[int]:
        """The keys mapped (a snapshot: the map may change meanwhile)."""
        return iter([k for t in self._shards for h, k in zip(t.hashes, t.keys, strict=True) if h])

    def clear(self) -> None:
        self.__init__()  # type: ignore[misc]

    def _split(self) -> None:
        (old,) = self._shards
        shift = HASH_BITS - SHARD_BITS
        shards = [_Pairs(max(_MIN, 2 * old.used >> SHARD_BITS)) for _ in range(1 << SHARD_BITS)]
        for stored, key in zip(old.hashes, old.keys, strict=True):
            if stored:
                shards[(stored - 1) >> shift].put(stored, key)
        self._shards, self._shift = shards, shift


class _Words:
    """One table of ``key << 16 | code`` words."""

    __slots__ = ("words", "size", "used")

    def __init__(self, size: int = _MIN) -> None:
        self.words, self.size, self.used = _empty(size), size, 0

    def put(self, word: int) -> None:
        words, size = self.words, self.size
        i = (word >> 16) % size
        while words[i]:
            i += 1
            if i == size:
                i = 0
        words[i] = word
        self.used += 1

    def vacate(self, i: int) -> None:
        """Empty entry ``i``, as ``_Pairs.vacate`` does."""
        words, size = self.words, self.size
        j = i
        while True:
            j += 1
            if j == size:
                j = 0
            word = words[j]
            if not word:
                break
            home = (word >> 16) % size
            if (i < home <= j) if i <= j else (home > i or home <= j):
                continue
            words[i] = word
            i = j
        words[i] = 0
        self.used -= 1

    def grow(self) -> None:
        old = self.words
        self.__init__(_grown(self.size))  # type: ignore[misc]
        for word in old:
            if word:
                self.put(word)


class Holders:
    """Block key -> the slots of the nodes holding it. One word a key: ``key << 16 | code``, the code being the
    one holder's slot plus one, or ``SHARED`` when several hold it (their bit mask is in ``shared``)."""

    __slots__ = ("shards", "shift", "shared", "_used")

    def __init__(self) -> None:
        self.shards = [_Words()]
        self.shift = KEY_BITS
        """A key's table is ``shards[key >> shift]``: one table until ``SPLIT_AT`` keys, then 256."""
        self.shared: dict[int, int] = {}
        self._used = 0

    def __len__(self) -> int:
        return self._used

    def mask(self, key: int) -> int:
        """Bit mask of the slots holding ``key`` (0: none)."""
        table = self.shards[key >> self.shift]
        words, size = table.words, table.size
        i = key % size
        while True:
            word = words[i]
            if not word:
                return 0
            if word >> 16 == key:
                code = word & SHARED
                return self.shared.get(key, 0) if code == SHARED else 1 << (code - 1)
            i += 1
            if i == size:
                i = 0

    def add(self, key: int, slot: int) -> None:
        """The node in ``slot`` holds ``key`` (too)."""
        self.add_all([key], slot)

    def add_all(self, keys: Iterable[int], slot: int) -> None:
        """The node in ``slot`` holds each of ``keys`` (too)."""
        shards, shift, shared = self.shards, self.shift, self.shared
        mine, bit, new = slot + 1, 1 << slot, 0
        for key in keys:
            table = shards[key >> shift]
            words, size = table.words, table.size
            i = key % size
            while word := words[i]:
                if word >> 16 == key:
                    code = word & SHARED
                    if code == SHARED:
                        shared[key] |= bit
                    elif code != mine:
                        shared[key] = (1 << (code - 1)) | bit
                        words[i] = key << 16 | SHARED
                    break
                i += 1
                if i == size:
                    i = 0
            else:
                words[i] = key << 16 | mine
                table.used += 1
                new += 1
                if _over(table.used, size):
                    table.grow()
        self._used += new
        if self._used > SPLIT_AT and self.shift == KEY_BITS:
            self._split()

    def release(self, key: int, slot: int) -> None:
        """The node in ``slot`` no longer holds ``key``."""
        self.release_all([key], slot)

    def release_all(self, keys: Iterable[int], slot: int) -> None:
        """The node in ``slot`` no longer holds any of ``keys``."""
        shards, shift, shared = self.shards, self.shift, self.shared
        mine, bit, gone = slot + 1, 1 << slot, 0
        for key in keys:
            table = shards[key >> shift]
            words, size = table.words, table.size
            i = key % size
            while word := words[i]:
                if word >> 16 == key:
                    break
                i += 1
                if i == size:
                    i = 0
            else:
                continue
            code = word & SHARED
            if code == SHARED:
                mask = shared[key] & ~bit
                if mask & (mask - 1):
                    shared[key] = mask
                    continue
                del shared[key]
                if mask:
                    words[i] = key << 16 | mask.bit_length()  # one holder left: its slot plus one
                    continue
            elif code != mine:
                continue
            table.vacate(i)
            gone += 1
        self._used -= gone

    def _split(self) -> None:
        (old,) = self.shards
        shift = KEY_BITS - HOLDER_SHARD_BITS
        shards = [_Words(max(_MIN, 2 * old.used >> HOLDER_SHARD_BITS)) for _ in range(1 << HOLDER_SHARD_BITS)]
        for word in old.words:
            if word:
                shards[word >> (16 + shift)].put(word)
        self.shards, self.shift = shards, shift
