"""How many conversations each node is serving, read from the shape of its KV events: the same count on every
replica, at the events' latency (milliseconds), where the scraped load is a fraction of a second old.

A node stores a conversation's blocks as a chain: its first request stores the blocks of its prompt (after
whatever prefix the node had), then each block its answer fills, then the next turn the blocks after the last
one it had. So a store whose parent is the last block of an earlier store (a *tip*) continues that conversation,
and any other store (from the root, or from the middle of a chain: a shared preamble, an earlier turn) begins
one. A conversation counts while its tip moved within ``WINDOW`` seconds, even if the node evicted it since:
the count says where conversations were placed lately, and eviction depends on how busy a node's cache is, not on
whether the conversation goes on (counting only cached tips would make the nodes that evict most look emptiest).

The tips also tell a conversation's next turn from a new conversation sharing its start (a document, a long
preamble): the next turn's prefix cached on the node ends at a tip; the new one's ends inside a chain that goes
on (``is_tip``; tips are kept for this without the window, up to ``MAX_TIPS`` a node). The block before a tip
counts as its end too: a history that tokenizes a little differently from what was generated (where the answer
ends) leaves the next turn's cached prefix a block short of the tip.

Blocks are named by the index's keys (index.py), which every replica computes alike. Exceptions this does not
see: a turn whose prompt the node holds whole and whose answer fills no block stores
nothing (the conversation may age out early); a chat whose history renders differently from what was generated
forks before the tip (counted as a new one; the old one ages out); a conversation whose last blocks the node
evicted ends inside its chain, like a new one. These only make a count an estimate.
"""

from __future__ import annotations

WINDOW = 60.0
"""Seconds after its last stored block that a conversation still counts (a user reading the answer and typing
the next turn)."""
MAX_TIPS = 100_000
"""Tips kept per node at most (the oldest go first)."""


class Conversations:
    """One node's conversations: the keys of their chains' last blocks, and when each moved (oldest first)."""

    __slots__ = ("_tips", "_before", "_moved", "begun", "_window")

    def __init__(self, window: float = WINDOW) -> None:
        self._tips: dict[int, int | None] = {}
        """Every tip, however old (bounded) -> the block before it: for ``is_tip``."""
        self._before: dict[int, int] = {}
        """The block before a tip -> the tip."""
        self._moved: dict[int, float] = {}
        """Tips that moved within the window -> when: for ``active``."""
        self.begun = 0
        """Conversations begun here, ever (a counter: routing/kv_aware.py matches its own placements against it)."""
        self._window = window

    def stored(self, parent: int | None, before: int | None, last: int, now: float) -> None:
        """A store of new blocks after ``parent`` (None: from the root), ending with ``before`` and ``last``."""
        tips, moved = self._tips, self._moved
        if parent is None or parent not in tips:
            self.begun += 1
        else:
            self._untip(parent)
            moved.pop(parent, None)
        self._untip(last)
        tips[last] = before
        if before is not None:
            self._before[before] = last
        moved.pop(last, None)
        moved[last] = now
        if len(tips) > MAX_TIPS:
            self._untip(next(iter(tips)))
        if len(moved) > MAX_TIPS:
            del moved[next(iter(moved))]

    def _untip(self, tip: int) -> None:
        if tip in self._tips:
            before = self._tips.pop(tip)
            if before is not None and self._before.get(before) == tip:
                del self._before[before]

    def is_tip(self, key: int) -> bool:
        """Whether a chain stored here ends at the block ``key``, or at the one after it (none of its stores
        went on from there yet)."""
        return key in self._tips or key in self._before

    def clear(self) -> None:
        self._tips.clear()
        self._before.clear()
        self._moved.clear()

    def active(self, now: float) -> int:
        """Conversations whose tip moved within the window."""
        moved, oldest = self._moved, now - self._window
        while moved:
            first = next(iter(moved))
            if moved[first] > oldest:
                break
            del moved[first]
        return len(moved)
