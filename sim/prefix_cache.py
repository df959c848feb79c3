"""Automatic prefix caching as vLLM V1 keeps it (vllm/v1/core/kv_cache_utils.py, block_pool.py,
kv_cache_manager.py), reduced to block hashes and counts: no KV data, no I/O.

- Full blocks of ``block_size`` token ids are hashed as a chain: a block's hash covers its parent's hash and its
  own ids, so one equal hash means an equal prefix. A partial last block is never cached.
- Looking a prompt up (when the request is scheduled) hits its leading blocks already known, at most
  ``(num_tokens - 1) // block_size`` of them: vLLM always recomputes the last prompt token to get its logits.
  Stats follow PrefixCacheStats: ``queries`` += prompt tokens, ``hits`` += hit tokens.
- A running request pins its prompt's blocks. When it ends, the blocks its generated tokens completed are cached
  too (all but the last token have KV), and all its blocks become evictable, tail blocks first, then in
  least-recently-freed order.
- ``capacity`` blocks hold the pinned ones, the partial blocks of running requests and the evictable cache; a new
  block evicts the oldest evictable one. Running requests are never preempted: past capacity, usage reads 1.
- ``usage`` is what vllm:kv_cache_usage_perc reports: blocks held by running requests over capacity (cached but
  unreferenced blocks count as free, as in BlockPool.get_usage).
- ``capacity`` 0 disables caching: no lookups, no stats (like --no-enable-prefix-caching).
- A request's ``cache_salt`` and LoRA adapter go into its first block's hash (vLLM mixes the adapter into every
  block's, the salt into the first's; chained, the effect is the same): requests with different salts or adapters
  never share a cached block, whatever their tokens.
- A ``listener`` hears of every block that enters the cache (with its parent and token ids), leaves it, or of
  the whole cache cleared: what vLLM publishes as KV-cache events (kvevents.py).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Protocol

ROOT = b"vllm-sim-prefix-cache"
"""The first block's parent (vLLM's NONE_HASH, fixed here so that hashes are stable across nodes)."""


def salted_root(salt: str | None, lora: str | None = None) -> bytes:
    """The first block's parent for requests with ``salt`` and of adapter ``lora`` (ROOT without either)."""
    if salt is None and lora is None:
        return ROOT
    mixed = f"{lora or ''}\0{salt or ''}\0{int(salt is not None)}".encode()
    return blake2b(ROOT + b"\0" + mixed, digest_size=16).digest()


def block_hashes(ids: Sequence[int], block_size: int, parent: bytes = ROOT) -> list[bytes]:
    """Chained hashes of the full blocks of ``ids`` (ids must fit 32 bits)."""
    hashes = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = blake2b(parent + array("I", ids[start : start + block_size]).tobytes(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


class CacheListener(Protocol):
    def stored(
        self,
        parent: bytes | None,
        blocks: Sequence[bytes],
        token_ids: Sequence[int],
        *,
        lora: str | None = None,
        salt: str | None = None,
    ) -> None:
        """``blocks`` (consecutive, after ``parent``; None: the first block) entered the cache, for a request of
        adapter ``lora``; ``salt`` is the request's cache_salt when the first of them is its first block."""

    def removed(self, blocks: Sequence[bytes]) -> None:
        """``blocks`` were evicted."""

    def cleared(self) -> None:
        """Every block left the cache."""


@dataclass(eq=False, kw_only=True)
class Lease:
    """One running request's hold on the cache."""

    prompt: Sequence[int]
    hashes: list[bytes]
    """The prompt's full blocks, pinned while the request runs."""
    hit_tokens: int
    """Prompt tokens found in the cache at lookup."""
    tokens: int
    """Context length so far (prompt + generated); the engine counts generated tokens here."""
    root: bytes = ROOT
    """The first block's parent: ROOT, or the request's cache_salt and adapter mixed in."""
    salt: str | None = None
    lora: str | None = None


@dataclass(kw_only=True)
class PrefixCache:
    block_size: int
    capacity: int
    """Blocks; 0 disables caching."""
    queries: int = 0
    """Prompt tokens looked up."""
    hits: int = 0
    """Prompt tokens found cached."""
    _pinned: dict[bytes, int] = field(default_factory=dict)
    """Block hash -> number of running requests holding it."""
    _free: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    """Cached blocks no running request holds, first evicted first."""
    _leases: set[Lease] = field(default_factory=set)
    listener: CacheListener | None = None

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def admit(self, prompt: Sequence[int], salt: str | None = None, lora: str | None = None) -> Lease:
        """Look ``prompt`` up, count the stats and pin its blocks (the request is being scheduled)."""
        if not self.enabled:
            return Lease(prompt=prompt, hashes=[], hit_tokens=0, tokens=len(prompt))
        root = salted_root(salt, lora)
        hashes = block_hashes(prompt, self.block_size, root)
        hit = 0
        for block in hashes[: max(0, len(prompt) - 1) // self.block_size]:
            if block not in self._pinned and block not in self._free:
                break
            hit += 1
        self.queries += len(prompt)
        self.hits += hit * self.block_size
        lease = Lease(
            prompt=prompt,
            hashes=hashes,
            hit_tokens=hit * self.block_size,
            tokens=len(prompt),
            root=root,
            salt=salt,
            lora=lora,
        )
        self._announce(hashes, prompt, None, lease)
        for block in hashes:
            self._pin(block)
        self._leases.add(lease)
        self._evict()
        return lease

    def release(self, lease: Lease, generated: Sequence[int]) -> None:
        """The request ended after ``generated``: cache what it computed and unpin its blocks."""
        if lease not in self._leases:
            return
        self._leases.discard(lease)
        blocks = list(lease.hashes)
        computed = len(lease.prompt) + max(0, len(generated) - 1)
        done = len(blocks) * self.block_size
        if computed // self.block_size > len(blocks):
            tail = [*lease.prompt[done:], *generated][: computed - done]
            blocks += block_hashes(tail, self.block_size, blocks[-1] if blocks else lease.root)
            self._announce(blocks[len(lease.hashes) :], tail, lease.hashes[-1] if lease.hashes else None, lease)
            for block in blocks[len(lease.hashes) :]:
                self._pin(block)
        for block in reversed(blocks):
            self._unpin(block)
        self._evict()

    def clear(self) -> None:
        """Forget every cached block no running request holds (reset_prefix_cache, sleep)."""
        if self.listener is not None and self._free:
            if self._pinned:
                self.listener.removed(list(self._free))
            else:
                self.listener.cleared()
        self._free.clear()

    def _announce(self, blocks: Sequence[bytes], ids: Sequence[int], parent: bytes | None, lease: Lease) -> None:
        """Tell the listener of the runs of ``blocks`` not cached yet (``ids`` their tokens from the first on,
        ``parent`` the block before the first; None: it is ``lease``'s first)."""
        if self.listener is None:
            return
        size, run = self.block_size, -1
        for i, block in enumerate([*blocks, None]):
            new = block is not None and block not in self._pinned and block not in self._free
            if new and run < 0:
                run = i
            elif not new and run >= 0:
                before = blocks[run - 1] if run else parent
                salt = lease.salt if before is None else None
                self.listener.stored(before, blocks[run:i], ids[run * size : i * size], lora=lease.lora, salt=salt)
                run = -1

    def _pin(self, block: bytes) -> None:
        self._free.pop(block, None)
        self._pinned[block] = self._pinned.get(block, 0) + 1

    def _unpin(self, block: bytes) -> None:
        left = self._pinned[block] - 1
        if left:
            self._pinned[block] = left
        else:
            del self._pinned[block]
            self._free[block] = None

    def _partial_blocks(self) -> int:
        """Blocks running requests fill beyond their pinned prompt blocks (uncached partial and decode blocks)."""
        size = self.block_size
        return sum(-(-lease.tokens // size) - len(lease.hashes) for lease in self._leases)

    def _evict(self) -> None:
        excess = len(self._pinned) + self._partial_blocks() + len(self._free) - self.capacity
        evicted = []
        while excess > 0 and self._free:
            evicted.append(self._free.popitem(last=False)[0])
            excess -= 1
        if evicted and self.listener is not None:
            self.listener.removed(evicted)

    @property
    def used_blocks(self) -> int:
        return len(self._pinned) + self._partial_blocks() if self.enabled else 0

    @property
    def cached_blocks(self) -> int:
        """Blocks whose hash is known: pinned or evictable."""
        return len(self._pinned) + len(self._free)

    @property
    def usage(self) -> float:
        return min(1.0, self.used_blocks / self.capacity) if self.enabled else 0.0

    def stats(self) -> dict[str, int | float]:
        """For GET /sim/requests."""
        return {
            "block_size": self.block_size,
            "capacity_blocks": self.capacity,
            "used_blocks": self.used_blocks,
            "cached_blocks": self.cached_blocks,
            "usage": self.usage,
        }
