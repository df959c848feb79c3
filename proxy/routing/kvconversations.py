"""How many conversations each node is serving, read from the shape of its KV events: the same count on every
replica, at the events' latency (milliseconds), where the scraped load is a fraction of a second old.

A node stores a conversation's blocks as a chain: its first request stores the blocks of its prompt (after
whatever prefix the node had), then each block its answer fills, then the next turn the blocks after the last
one it had. So a store whose parent is the last block of an earlier store (a *tip*) continues that conversation,
and any other store (from the root, or from the middle of a chain: a shared preamble, an earlier turn) begins
one. A conversation counts while its tip moved within ``WINDOW`` seconds, even if the node evicted it since:
the count says where conversations were placed lately, and eviction depends on how busy a node's cache is, not on
whether the conversation goes on (counting only cached tips would make the nodes that evict most look emptiest).

Exceptions this does not see: a turn whose prompt the node holds whole and whose answer fills no block stores
nothing (the conversation may age out early); a chat whose history renders differently from what was generated
forks before the tip (counted as a new one; the old one ages out). Both only make a count an estimate.
"""

from __future__ import annotations

from collections.abc import Hashable

WINDOW = 60.0
"""Seconds after its last stored block that a conversation still counts (a user reading the answer and typing
the next turn)."""
MAX_TIPS = 100_000
"""Conversations tracked per node at most (the oldest go first)."""


class Conversations:
    """One node's conversation tips: engine hash of a chain's last block -> when it was stored (oldest first)."""

    __slots__ = ("_tips", "begun", "_window")

    def __init__(self, window: float = WINDOW) -> None:
        self._tips: dict[Hashable, float] = {}
        self.begun = 0
        """Conversations begun here, ever (a counter: kvchoice.py matches its own placements against it)."""
        self._window = window

    def stored(self, parent: Hashable | None, last: Hashable, now: float) -> None:
        """A store of new blocks after ``parent`` (None: from the root), ending with the block ``last``."""
        tips = self._tips
        if parent is None or tips.pop(parent, None) is None:
            self.begun += 1
        tips[last] = now
        if len(tips) > MAX_TIPS:
            del tips[next(iter(tips))]

    def clear(self) -> None:
        self._tips.clear()

    def active(self, now: float) -> int:
        """Conversations whose tip moved within the window."""
        tips, oldest = self._tips, now - self._window
        while tips:
            first = next(iter(tips))
            if tips[first] > oldest:
                break
            del tips[first]
        return len(tips)
