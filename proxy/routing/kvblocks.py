"""One node's block hashes -> index keys, packed into two arrays of 64-bit ints (``BlockMap``).

A dict of Python ints costs a block two int objects (32 bytes each) plus its entry (24 bytes, and as much again
at the growth points); here a block is two 8-byte slots at a load of 1/3 to 2/3 (about 32 bytes), and the key
int the index's holder map keeps is the only object. Open addressing with linear probing; a removal shifts the
entries after it back (no tombstones), so a table only ever grows by doubling, which copies it in this thread
(about 10 ms at 40,000 blocks, ~0.2 s once for a node nearing the index's 1,000,000). A store or removal costs
~0.5-1 us here against ~0.1-0.2 us in a dict; routing's lookups do not come here. Hashes and keys are below
2^60 (kvwire.py and kvindex.py fold them so); a slot holding 0 is empty, a hash is stored plus one.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

_MIN = 16
_FOLD = (1 << 60) - 1


class BlockMap:
    """A dict from 60-bit engine hashes to 60-bit keys, for the methods the index uses."""

    __slots__ = ("_hashes", "_keys", "_mask", "_used")

    def __init__(self) -> None:
        self._hashes, self._keys, self._mask, self._used = _empty(_MIN), _empty(_MIN), _MIN - 1, 0

    def __len__(self) -> int:
        return self._used

    def get(self, engine_hash: int) -> int | None:
        h = engine_hash & _FOLD
        hashes, mask, stored = self._hashes, self._mask, h + 1
        i = (h ^ (h >> 31)) & mask
        while True:  # the probe, written out in get, add and pop: a call more would cost every block ~0.1 us
            found = hashes[i]
            if found == stored:
                return self._keys[i]
            if not found:
                return None
            i = (i + 1) & mask

    def __contains__(self, engine_hash: int) -> bool:
        return self.get(engine_hash) is not None

    def add(self, engine_hash: int, key: int) -> bool:
        """Map ``engine_hash`` to ``key`` unless it is mapped already; whether it was added."""
        h = engine_hash & _FOLD
        hashes, mask, stored = self._hashes, self._mask, h + 1
        i = (h ^ (h >> 31)) & mask
        while True:
            found = hashes[i]
            if found == stored:
                return False
            if not found:
                break
            i = (i + 1) & mask
        hashes[i], self._keys[i] = stored, key
        self._used += 1
        if self._used * 3 > len(self._hashes) * 2:
            self._grow()
        return True

    def pop(self, engine_hash: int) -> int | None:
        """Unmap ``engine_hash``; its key (None: it was not mapped)."""
        hashes, keys, mask = self._hashes, self._keys, self._mask
        h = engine_hash & _FOLD
        stored, i = h + 1, (h ^ (h >> 31)) & mask
        while True:
            found = hashes[i]
            if found == stored:
                break
            if not found:
                return None
            i = (i + 1) & mask
        key = keys[i]
        j = i
        while True:  # the entries after i in its run move back unless their home slot lies in (i, j]
            j = (j + 1) & mask
            found = hashes[j]
            if not found:
                break
            home = ((found - 1) ^ ((found - 1) >> 31)) & mask
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
        self._hashes, self._keys, self._mask, self._used = _empty(_MIN), _empty(_MIN), _MIN - 1, 0

    def _grow(self) -> None:
        old = zip(self._hashes, self._keys, strict=True)
        size = len(self._hashes) * 2
        self._hashes, self._keys, self._mask = _empty(size), _empty(size), size - 1
        hashes, keys, mask = self._hashes, self._keys, self._mask
        for stored, key in old:
            if stored:
                h = stored - 1
                i = (h ^ (h >> 31)) & mask
                while hashes[i]:
                    i = (i + 1) & mask
                hashes[i], keys[i] = stored, key


def _empty(size: int) -> array[int]:
    return array("Q", bytes(8 * size))
