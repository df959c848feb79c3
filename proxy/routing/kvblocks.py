"""The index's two maps, packed into arrays of 64-bit ints: a node's engine hashes -> keys (``BlockMap``), and
block keys -> the nodes holding them (``Holders``).

A dict of Python ints costs a block two int objects (32 bytes each) and an entry (24 bytes, plus its share of
the table's empty room); here a block is one 8-byte word in ``Holders`` (its 48-bit key and, in the low 16 bits,
its holder) and two in its node's ``BlockMap``, with no object of its own. Open addressing with linear probing,
at a load of 0.53-0.8: a table grows by half when it passes 0.8, so it never sits much emptier than that (a
doubling table sits at 0.4-0.8, which would cost a third more). A removal shifts the entries after it back (no
tombstones). Growing copies a table at once in the ingest thread (about 10 ms at 40,000 blocks). Each store or
removal is ~0.5-1 us of Python where a dict's was ~0.1-0.2; routing's lookups read ``Holders`` (kvindex.py walks
its words itself, to save a call per key). Engine hashes are below 2^60 (kvwire.py folds them), stored plus one
so that 0 means empty; keys below 2^48 (kvindex.py folds them).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

_MIN = 16
_FOLD = (1 << 60) - 1
KEY_BITS = 48
"""Bits of a block key: with a 16-bit holder they fill one word (a false match of two prefixes' keys is a 1 in
10^7 chance at 5,000,000 keys: it could only make one request look cached where it is not)."""
SHARED = 0xFFFF
"""A holder code meaning "several nodes": their bit mask is kept apart, in ``Holders.shared``."""
MAX_SLOTS = SHARED - 1
"""Nodes a ``Holders`` table can name (a slot is stored plus one)."""


def _over(used: int, size: int) -> bool:
    return used * 5 > size * 4


def _grown(size: int) -> int:
    return size + size // 2


def _empty(size: int) -> array[int]:
    return array("Q", bytes(8 * size))


class BlockMap:
    """A dict from 60-bit engine hashes to 48-bit keys, for the methods the index uses."""

    __slots__ = ("_hashes", "_keys", "_size", "_used")

    def __init__(self) -> None:
        self._hashes, self._keys, self._size, self._used = _empty(_MIN), _empty(_MIN), _MIN, 0

    def __len__(self) -> int:
        return self._used

    def get(self, engine_hash: int) -> int | None:
        h = engine_hash & _FOLD
        hashes, size, stored = self._hashes, self._size, h + 1
        i = h % size
        while True:  # the probe, written out in get, add and pop: a call more would cost every block ~0.1 us
            found = hashes[i]
            if found == stored:
                return self._keys[i]
            if not found:
                return None
            i += 1
            if i == size:
                i = 0

    def __contains__(self, engine_hash: int) -> bool:
        return self.get(engine_hash) is not None

    def add(self, engine_hash: int, key: int) -> bool:
        """Map ``engine_hash`` to ``key`` unless it is mapped already; whether it was added."""
        h = engine_hash & _FOLD
        hashes, size, stored = self._hashes, self._size, h + 1
        i = h % size
        while True:
            found = hashes[i]
            if found == stored:
                return False
            if not found:
                break
            i += 1
            if i == size:
                i = 0
        hashes[i], self._keys[i] = stored, key
        self._used += 1
        if _over(self._used, size):
            self._grow()
        return True

    def pop(self, engine_hash: int) -> int | None:
        """Unmap ``engine_hash``; its key (None: it was not mapped)."""
        hashes, keys, size = self._hashes, self._keys, self._size
        h = engine_hash & _FOLD
        stored, i = h + 1, h % size
        while True:
            found = hashes[i]
            if found == stored:
                break
            if not found:
                return None
            i += 1
            if i == size:
                i = 0
        key = keys[i]
        j = i
        while True:  # the entries after i in its run move back unless their home slot lies in (i, j]
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
        self._used -= 1
        return key

    def values(self) -> Iterator[int]:
        """The keys mapped (a snapshot: the map may change meanwhile)."""
        return iter([k for h, k in zip(self._hashes, self._keys, strict=True) if h])

    def clear(self) -> None:
        self._hashes, self._keys, self._size, self._used = _empty(_MIN), _empty(_MIN), _MIN, 0

    def _grow(self) -> None:
        old = zip(self._hashes, self._keys, strict=True)
        size = _grown(self._size)
        hashes, keys = _empty(size), _empty(size)
        for stored, key in old:
            if stored:
                i = (stored - 1) % size
                while hashes[i]:
                    i += 1
                    if i == size:
                        i = 0
                hashes[i], keys[i] = stored, key
        self._hashes, self._keys, self._size = hashes, keys, size


class Holders:
    """Block key -> the slots of the nodes holding it. One word a key: ``key << 16 | code``, the code being the
    one holder's slot plus one, or ``SHARED`` when several hold it (their bit mask is in ``shared``)."""

    __slots__ = ("table", "shared", "_used")

    def __init__(self) -> None:
        self.table: tuple[array[int], int] = (_empty(_MIN), _MIN)
        """(words, size), replaced as one when the table grows, so a reader never pairs one table's words with
        another's size."""
        self.shared: dict[int, int] = {}
        self._used = 0

    def __len__(self) -> int:
        return self._used

    def mask(self, key: int) -> int:
        """Bit mask of the slots holding ``key`` (0: none)."""
        words, size = self.table
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
        words, size = self.table
        i = key % size
        while True:
            word = words[i]
            if not word:
                break
            if word >> 16 == key:
                code = word & SHARED
                if code == SHARED:
                    self.shared[key] |= 1 << slot
                elif code != slot + 1:
                    self.shared[key] = (1 << (code - 1)) | (1 << slot)
                    words[i] = key << 16 | SHARED
                return
            i += 1
            if i == size:
                i = 0
        words[i] = key << 16 | (slot + 1)
        self._used += 1
        if _over(self._used, size):
            self._grow()

    def release(self, key: int, slot: int) -> None:
        """The node in ``slot`` no longer holds ``key``."""
        words, size = self.table
        i = key % size
        while True:
            word = words[i]
            if not word:
                return
            if word >> 16 == key:
                break
            i += 1
            if i == size:
                i = 0
        code = word & SHARED
        if code != SHARED:
            if code == slot + 1:
                self._remove(words, size, i)
            return
        mask = self.shared[key] & ~(1 << slot)
        if mask & (mask - 1):
            self.shared[key] = mask
            return
        del self.shared[key]
        if mask:
            words[i] = key << 16 | mask.bit_length()  # one holder left: its slot plus one
        else:
            self._remove(words, size, i)

    def _remove(self, words: array[int], size: int, i: int) -> None:
        j = i
        while True:  # as BlockMap.pop: shift back the entries whose home slot is not in (i, j]
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
        self._used -= 1

    def _grow(self) -> None:
        old, _ = self.table
        size = _grown(len(old))
        words = _empty(size)
        for word in old:
            if word:
                i = (word >> 16) % size
                while words[i]:
                    i += 1
                    if i == size:
                        i = 0
                words[i] = word
        self.table = (words, size)
