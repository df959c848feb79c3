"""The kv-aware policy: the node holding the longest cached prefix of the request, weighed against load.

- Nodes whose KV events this replica follows (tracked: connected, not silent; kvcache/subscription.py) are judged by
  the index. When a node that is not overloaded (load, ``node_load``: the node's own running and waiting, or
  this replica's in flight, above ``1 + EPSILON`` times the mean plus ``SLACK``; or a KV cache nearly full)
  holds at least ``CACHED_SHARE`` of the prompt, the longest prefix wins (reason ``cached_prefix``): the next
  turn of a conversation stays where its cache is. When several nodes hold that longest prefix, it is a
  preamble that conversations share, and the request is a new conversation, placed as below; so is a prompt
  that goes on past its node's prefix from inside one of the node's chains (a document another conversation
  began with), where a next turn goes on from a chain's last block (kvcache/conversations.py tells them apart).
- Otherwise (a new conversation, which at most shares a preamble with others) the node serving the fewest
  conversations wins (as its events show them, kvcache/conversations.py, plus those this replica sent it that its
  events do not show yet; divided by its speed weight, so a slow node takes fewer), then the least loaded, ties
  broken by a hash of the request's affinity key and the node (reason ``load``). Every replica counts the same
  conversations from the same events within milliseconds, where loads are scraped a fraction of a second
  apart, so conversations spread evenly over the nodes whichever replica each begins on -- unless, when no
  node holds any of it, today's content affinity would place it on a node whose events are not followed, which
  keeps its share (reason ``fallback``).
- No tracked node, or a prompt whose token ids are unknown: content affinity (``CacheAware``; ``fallback``).
- Where a request went is remembered as if the node had announced its blocks, so the next turn of a quick
  conversation follows it before the node's events arrive: until the node's next batch of events (which
  says what it really holds) or ``REMEMBER`` seconds, whichever comes first.
- A prompt's keys are worked out only for its first ``HEAD_TOKENS`` tokens while no node holds (or was just sent)
  its first block: no later block can be a hit then, so the rest of a long prompt is not tokenized for it (it is
  when a later request finds its start cached), and only those first keys are remembered where it went. Likewise
  a prompt that goes on past what some node holds with more than ``LAZY_REST`` new tokens (a document, a tool's
  output) is read piece by piece only to the first block no node holds; its length for ``CACHED_SHARE`` is then
  reckoned from the part read.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence

from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.kvcache.index import KvIndex
from vllm_etcd_proxy.proxy.kvcache.prompt.ids import KvPrompt
from vllm_etcd_proxy.proxy.routing.balancer import CacheAware, _mix, _stable_hash, _untried, node_load, speed_weights

REMEMBER = 5.0
"""Seconds a routing decision counts as the node holding the prompt's blocks (its events confirm it sooner)."""
MAX_REMEMBERED = 200_000
"""Block keys remembered at most (a few seconds of traffic)."""
CACHED_SHARE = 0.5
"""The share of the prompt a node must hold for its prefix to draw the request: less (a shared preamble, the
start of a new conversation) and the request goes by load, so that conversations spread evenly."""
EPSILON, SLACK = 0.5, 2
"""A node is overloaded when its load exceeds ``1 + EPSILON`` times the mean plus ``SLACK`` requests (as for
cache-aware): then its prefix does not draw the request."""
KV_FULL = 0.95
PENDING = 2.0
"""Seconds a conversation this replica began on a node counts there before the node's events show it."""
LAZY_REST = 2048
"""Tokens (about) of a prompt past the last block some node holds, beyond which the rest is not tokenized for
routing (a quick next turn, sent before the node's events, then finds only the part read remembered)."""
ABOUT_MARGIN = 1.25
"""How far a prompt read in part may be longer (or shorter) than its part read says before its length is counted
exactly for ``CACHED_SHARE`` (``KvAware._holds_most``)."""
HEAD_TOKENS = 1024
"""Tokens of a prompt whose keys are worked out while no node holds its first block (module docstring): a
shorter prompt is read whole (so that its quick next turn finds all of it remembered), a longer one costs a
replica only as much tokenizing as a prompt of this length."""


def _adapter(model: str, pool: Sequence[NodeState]) -> str:
    """The LoRA adapter's name when ``model`` is one (its card names a parent), else "" (the base model)."""
    for state in pool:
        card = state.cards.get(model)
        if card is not None:
            return model if card.get("parent") else ""
    return ""


def _expire(expiry: deque[tuple[float, int, int]], table: dict[int, int], now: float) -> None:
    """Take out of ``table`` (key -> bit mask of slots) the (until, key, bit) entries of ``expiry`` that are due,
    or beyond ``MAX_REMEMBERED``."""
    while expiry and (expiry[0][0] <= now or len(expiry) > MAX_REMEMBERED):
        _, key, bit = expiry.popleft()
        left = table.get(key, 0) & ~bit
        if left:
            table[key] = left
        else:
            table.pop(key, None)


class KvRouting:
    """What the policy and the request path share: the index, which nodes are tracked, recent decisions."""

    def __init__(
        self,
        index: KvIndex,
        tracked: Callable[[str], bool],
        active: Callable[[], bool] = lambda: True,
        remember: float = REMEMBER,
    ) -> None:
        self.index = index
        self.tracked = tracked
        self.active = active
        """Whether any node publishes events at all (else prompts need not be read)."""
        self.decisions: Counter[str] = Counter()
        self._remember = remember
        self._recent: dict[int, int] = {}
        self._expiry: deque[tuple[float, int, int]] = deque()
        self._valid: dict[int, tuple[int | None, float]] = {}
        """slot -> (its index version, until when) at the last decision for it."""
        self._sent_tips: dict[int, int] = {}
        """Last block key of a prompt this replica sent -> slots it went to (until the node's events say more)."""
        self._tip_expiry: deque[tuple[float, int, int]] = deque()
        self._begun: dict[str, tuple[int, deque[float]]] = {}
        """node -> (its conversations begun, as last seen; when this replica began ones not seen since)."""

    def _valid_slots(self, now: float) -> int:
        """The slots whose remembered decisions still count: no event from the node since, not expired."""
        mask, index = 0, self.index
        for slot, (version, until) in list(self._valid.items()):
            if until <= now or index.version(slot) != version:
                del self._valid[slot]
            else:
                mask |= 1 << slot
        return mask

    def recent(self) -> dict[int, int]:
        """Block key -> slots this replica sent it to within ``REMEMBER`` seconds."""
        now = time.monotonic()
        _expire(self._expiry, self._recent, now)
        _expire(self._tip_expiry, self._sent_tips, now)
        return self._recent

    def continues(self, state: NodeState, key: int) -> bool:
        """Whether a prompt whose prefix cached on the node ends at the block ``key`` is the next turn of a
        conversation there: a chain the node stored ends there, or this replica just sent it a prompt ending
        there (its events may not say so yet); else it branches off a chain (a new conversation)."""
        with self.index.lock:
            blocks = self.index.node(state.entry_key)
            if blocks is not None and blocks.conversations.is_tip(key):
                return True
            return bool(self._sent_tips.get(key, 0) & (1 << self.index.slot_of(state.entry_key)))

    def sent(self, state: NodeState, keys: Sequence[int], held: int = 0, whole: bool = True) -> None:
        """The request with the block ``keys`` went to the node, which held its first ``held`` tokens already:
        only the keys after those are remembered (a long conversation's next turn adds a few). ``whole``: the
        keys are all the prompt's (not only its first ones), so the last is where its chain ends."""
        with self.index.lock:
            slot = self.index.slot_of(state.entry_key)
            version, blocks = self.index.version(slot), self.index.node(state.entry_key)
        bit = 1 << slot
        until = time.monotonic() + self._remember
        self._valid[slot] = (version, until)
        size = blocks.block_size if blocks is not None else 0
        if keys and whole:
            self._sent_tips[keys[-1]] = self._sent_tips.get(keys[-1], 0) | bit
            self._tip_expiry.append((until, keys[-1], bit))
        for key in keys[held // size :] if size and held else keys:
            self._recent[key] = self._recent.get(key, 0) | bit
            self._expiry.append((until, key, bit))

    def conversations(self, state: NodeState, now: float) -> int:
        """The conversations the node serves: by its events, plus those this replica just began there."""
        with self.index.lock:
            blocks = self.index.node(state.entry_key)
            begun, active = (blocks.conversations.begun, blocks.conversations.active(now)) if blocks else (0, 0)
        mine = self._begun.get(state.entry_key)
        if mine is None:
            return active
        seen, times = mine
        for _ in range(min(begun - seen, len(times))):
            times.popleft()  # a conversation begun since: count it as one of ours (it may be another's)
        while times and times[0] <= now - PENDING:
            times.popleft()
        if times:
            self._begun[state.entry_key] = (begun, times)
        else:
            del self._begun[state.entry_key]
        return active + len(times)

    def began(self, state: NodeState, now: float) -> None:
        """A new conversation was sent to the node (after ``conversations`` was asked for it)."""
        blocks = self.index.node(state.entry_key)
        begun = blocks.conversations.begun if blocks else 0
        self._begun.setdefault(state.entry_key, (begun, deque()))[1].append(now)

    def cached(self, prompt: KvPrompt, pool: Sequence[NodeState]) -> list[tuple[NodeState, int, list[int]]] | None:
        """(node, cached prompt tokens, the prompt's keys at its block size) for each tracked node; None when no
        node is tracked. The index's lock is held for its reads only: a prompt's keys may need tokenizing."""
        index, lora = self.index, _adapter(prompt.model, pool)
        with index.lock:
            groups = self._groups(pool)
        if not groups:
            return None
        sizes = [size for size in groups if size]
        recent = self.recent()
        valid = self._valid_slots(time.monotonic()) if recent else 0
        # A node yet to store anything is read at the block size of one that has.
        plans = [(size or (sizes[0] if sizes else 0), members, _mask(members)) for size, members in groups.items()]
        heads = {block: prompt.keys(block, lora, max(block, HEAD_TOKENS)) for block, _, _ in plans if block}
        # When some node holds the first block (or all the ids are known anyway), all the keys; else the first
        # ones only (module docstring).
        with index.lock:
            whole = prompt.complete or any(
                index.depths(heads[block][:1], mask, recent, valid) for block, _, mask in plans if block
            )
        found: list[tuple[NodeState, int, list[int]]] = []
        for block, members, mask in plans:
            keys: list[int]
            depths: dict[int, int]
            if not block:
                keys, depths = [], {}
            elif whole:
                keys, depths = self._deepest(prompt, block, lora, mask, recent, valid)
            else:
                keys = heads[block]
                with index.lock:
                    depths = index.depths(keys, mask, recent, valid)
            found += [(state, depths.get(slot, 0) * block, keys) for state, slot in members]
        return found

    def _deepest(
        self, prompt: KvPrompt, block: int, lora: str, mask: int, recent: dict[int, int], valid: int
    ) -> tuple[list[int], dict[int, int]]:
        """The prompt's keys at ``block`` and, for each slot in ``mask``, how many of them it holds in a row: the
        ids are read piece by piece until a block that no node holds; what follows is read too unless it is
        longer than ``LAZY_REST`` (a long new document or tool output is tokenized for its first block or two,
        not whole: no later block can be a hit)."""
        index, depths, alive, done = self.index, {}, mask, 0
        within = max(HEAD_TOKENS, len(prompt.head(0)) - 1)  # the ids known already cost nothing more
        while True:
            keys = prompt.keys(block, lora, within)
            if len(keys) > done:
                with index.lock:
                    more = index.depths(keys[done:], alive, recent, valid)
                alive = 0
                for slot, depth in more.items():  # the slots holding every key so far, and how far they go now
                    depths[slot] = done + depth
                    if done + depth == len(keys):
                        alive |= 1 << slot
                done = len(keys)
            if prompt.complete:
                return keys, depths
            if not alive:
                if prompt.about() - len(prompt.head(0)) > LAZY_REST:
                    return keys, depths
                # A short rest is read whole after all: the quick next turn then finds all of it remembered
                # (no node can hold more of it: every one stopped before its end).
                return prompt.keys(block, lora), depths
            within = max((done + 1) * block, len(prompt.head(0)) - 1)  # at least one block more: a piece more

    def _groups(self, pool: Sequence[NodeState]) -> dict[int, list[tuple[NodeState, int]]]:
        """The tracked nodes of ``pool`` with their slots, by the block size of their last store (0: none yet)."""
        index = self.index
        groups: dict[int, list[tuple[NodeState, int]]] = {}
        for state in pool:
            if self.tracked(state.entry_key):
                blocks = index.node(state.entry_key)
                groups.setdefault(blocks.block_size if blocks is not None else 0, []).append(
                    (state, index.slot_of(state.entry_key))
                )
        return groups

    def uncached(
        self, prompt: KvPrompt, pool: Sequence[NodeState], default: int | None = None, upto: int | None = None
    ) -> int | None:
        """The prompt's tokens that the tracked node holding most of it lacks (``default``: no node tracked).
        ``upto``: a count of at least that much need not be exact (a prompt no node holds any of is then read
        only that far)."""
        cached = self.cached(prompt, pool)
        if not cached:
            return default
        held = max(tokens for _, tokens, _ in cached)
        return (len(prompt.ids) if upto is None else len(prompt.head(held + upto))) - held


def _mask(members: Sequence[tuple[NodeState, int]]) -> int:
    mask = 0
    for _, slot in members:
        mask |= 1 << slot
    return mask


_Found = tuple[tuple[NodeState, int, list[int]], int]
"""(node, cached prompt tokens, the prompt's keys), and the node's load."""


class KvAware:
    """The kv-aware policy (module docstring); ``decisions`` counts its reasons."""

    name = "kv-aware"

    def __init__(
        self,
        routing: KvRouting,
        fallback: CacheAware | None = None,
        epsilon: float = EPSILON,
        slack: int = SLACK,
        share: float = CACHED_SHARE,
    ) -> None:
        self._routing = routing
        self._fallback = fallback or CacheAware()
        self._epsilon, self._slack, self._share = epsilon, slack, share

    def _branches(self, found: tuple[NodeState, int, list[int]]) -> bool:
        """Whether what the node holds of the prompt ends inside one of its chains: a new conversation sharing
        another's start (a document both begin with), not that one's next turn."""
        state, tokens, keys = found
        blocks = self._routing.index.node(state.entry_key)
        size = blocks.block_size if blocks is not None else 0
        depth = tokens // size if size else 0
        return depth > 0 and not self._routing.continues(state, keys[depth - 1])

    def _placement(
        self, roomy: Sequence[_Found], prompt: KvPrompt, key: str | None, now: float
    ) -> Callable[[_Found], tuple[float, int, int, int]]:
        """The rank of a node for a new conversation: fewest conversations for its speed, then most cached, then
        least loaded, then the node ranked first for the request's key (alike on every replica)."""
        routing, seed = self._routing, _stable_hash(key or f"prompt:{list(prompt.head(64)[:64])}")
        weights = dict(zip((id(c[0]) for c, _ in roomy), speed_weights([c[0] for c, _ in roomy]), strict=True))

        def rank(found: _Found) -> tuple[float, int, int, int]:
            (node, tokens, _), load = found
            spread = _mix(seed ^ _stable_hash(node.node.node_id))
            return routing.conversations(node, now) / weights[id(node)], -tokens, load, spread

        return rank

    def _decided(self, reason: str, state: NodeState | None) -> NodeState | None:
        self._routing.decisions[reason] += 1
        return state

    def choose(
        self,
        candidates: Sequence[NodeState],
        tried: Collection[NodeState] = (),
        key: str | None = None,
        prompt: KvPrompt | None = None,
    ) -> NodeState | None:
        pool = _untried(candidates, tried)
        if prompt is None or len(pool) <= 1:
            return self._decided("fallback", self._fallback.choose(pool, (), key))
        routing = self._routing
        cached = routing.cached(prompt, pool)
        if not cached:
            return self._decided("fallback", self._fallback.choose(pool, (), key))
        loads = [node_load(state) for state, _, _ in cached]
        roomy = [(c, n) for c, n in zip(cached, loads, strict=True) if c[0].kv_usage < KV_FULL]
        roomy = roomy or list(zip(cached, loads, strict=True))
        fair = (1 + self._epsilon) * sum(loads) / len(loads) + self._slack
        fit = [(c, n) for c, n in roomy if n <= fair]
        best = max((c[1] for c, _ in fit), default=0)
        top = [f for f in fit if f[0][1] == best] if self._holds_most(prompt, best) else []
        going_on = [f for f in top if not self._branches(f[0])]
        if len(going_on) == 1:
            # Most of the prompt is cached on a node that is not overloaded, where it is the next turn of a
            # conversation (its cached prefix ends where one of the node's chains does): it stays there.
            reason, ((state, held, keys), _) = "cached_prefix", going_on[0]
        else:
            if best == 0 and len(cached) < len(pool):
                affine = self._fallback.choose(pool, (), key)
                if affine is not None and not routing.tracked(affine.entry_key):
                    return self._decided("fallback", affine)
            # A new conversation (what is cached, if anything, is a preamble or a document other conversations
            # began with), or one whose node forgot it or is overloaded: where the fewest conversations are, then
            # where most is cached.
            now = time.monotonic()
            reason, ((state, held, keys), _) = "load", min(roomy, key=self._placement(roomy, prompt, key, now))
            routing.began(state, now)
        # Keys read until no node held the next block (some node held the first) end where the prompt goes on
        # as nothing cached does: where its chain ends, as far as any node knows.
        routing.sent(state, keys, held, prompt.complete or any(tokens for _, tokens, _ in cached))
        return self._decided(reason, state)

    def _holds_most(self, prompt: KvPrompt, best: int) -> bool:
        """Whether ``best`` cached tokens are at least the share of the prompt that draws it to their node. For a
        prompt read only in part, its length is reckoned from the part read (a long new message is not
        tokenized for this), and counted exactly only when that reckoning, a quarter out either way, cannot
        tell."""
        if not best:
            return False
        if not prompt.complete:
            about = prompt.about()
            if best >= self._share * (ABOUT_MARGIN * about - 1):
                return True
            if best < self._share * (about / ABOUT_MARGIN - 1):
                return False
        return best >= self._share * (len(prompt.ids) - 1)
