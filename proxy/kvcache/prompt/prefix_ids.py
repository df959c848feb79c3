"""A chat's token ids, worked out piece by piece, reusing the pieces that earlier prompts began with.

Tokenizers restart at special tokens (added tokens are split out before anything else runs), and their
pre-tokenizers begin a new piece before a word (`` word``: byte-level BPE's regex, WordPiece's whitespace split and
SentencePiece's Metaspace alike). So a text *cut* right after a special token, or before a space that follows a
non-space and precedes a letter, tokenizes as its two sides do, for tokenizers that treat the start of a text
like any other place. ``Splitter.checked`` tries both kinds of cut on the model's own tokenizer and template and
keeps those that hold (neither: chats are tokenized whole). A rendered chat is cut after every special token and,
in a longer run of text, at the first word start past every ``SOFT_CUT`` characters.

``ChatIds`` works a rendered chat out piece by piece, only as far as the router asks (when no node holds the
start of a prompt, the rest of it cannot be a hit, routing/kv_aware.py). ``PrefixIds`` keeps the pieces it
tokenizes as a tree: each piece with its text, its ids and the pieces that came after it in some prompt. A later
prompt that begins with the same text -- the next turn, or another conversation with the same preamble, tool list or
document -- walks down the tree comparing text (which runs at memory speed: the cached part of a prompt is
neither searched for cuts nor hashed) and tokenizes only what follows. The index's block keys of a prompt are
kept with its pieces too (each piece the keys of the blocks that end in it), so a later prompt hashes only the
blocks after the pieces it shares. Tokenizing in pieces is cheaper even when
nothing is reused: the tokenizers library's cost per token grows with the length of the text it is given
(bench/README.md).
"""

from __future__ import annotations

import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer

CACHE_TOKENS = 4_000_000
"""Ids held by the prefix cache of one replica, over all models: 8 bytes each (the ints are shared) and their text
(about 5 bytes per token of English), so about 50 MB at most."""
SOFT_CUT = 4096
"""Characters of text at least between two cuts at word starts: about a thousand tokens, which a replica
tokenizes in under a millisecond, where a piece read back from the cache costs it about a microsecond."""
FIRST_CUT = 256
"""Characters of a run of text (between special tokens) before its first cut at a word start: a new message's
first block or two (the only ones a node may hold when it goes on past a cached prefix) without tokenizing the
rest of it (a long tool output or file, say) for the routing decision."""
PROBE = 16
"""Leading characters that the pieces after a piece are found by (then compared whole)."""

KEY_COST = 4
"""Cached ids a kept block key counts as, against ``CACHE_TOKENS``: a key is an int of its own (~40 bytes in a
tuple), where an id is a pointer to a shared one (8)."""
_WORD_START = re.compile(r"(?<=\S) (?=[^\W\d_])")
"""A space between a non-space and a letter: where a soft cut goes (the space starts the next piece)."""
_INTS: list[int] = []
"""One int object per token id, shared by every piece cached: 8 bytes per id cached instead of 36."""
_GROWING = threading.Lock()


class Count(Protocol):
    """What ``ChatIds`` counts ids on (a Prometheus counter's child)."""

    def inc(self, amount: float = 1) -> None: ...


KeysTag = tuple[int, str, str]
"""(block size, LoRA adapter, cache salt): what a prompt's block keys depend on besides its ids."""


class Piece:
    """A piece of an earlier prompt's text (from one cut to the next), its ids, and the pieces that came after it."""

    __slots__ = ("text", "ids", "special", "parent", "after", "after_short", "keys")

    def __init__(self, text: str, ids: tuple[int, ...], special: int, parent: Piece | None) -> None:
        self.text, self.ids, self.parent = text, ids, parent
        self.special = special
        """The length of the special token the piece ends with (0: it ends before a word)."""
        self.after: dict[str, list[Piece]] = {}
        """The pieces after it of ``PROBE`` characters or more, by their first ``PROBE``."""
        self.after_short: list[Piece] = []
        self.keys: dict[KeysTag, tuple[int, ...]] | None = None
        """The index's keys of the blocks that end within this piece's ids, where a prompt that went through here
        had them worked out. A block's key covers every id before it, which are the same for every prompt down
        this path: a later prompt reads the keys of the pieces it shares and hashes only the blocks after."""

    def children(self) -> list[Piece]:
        return [*self.after_short, *(p for same in self.after.values() for p in same)]


class EndsAt(Protocol):
    def __call__(self, text: str, end: int, special: int, /) -> bool: ...


class PrefixIds:
    """The pieces of earlier prompts as a tree (a root per tokenizer's splitter), least recently used first out,
    holding at most ``max_tokens`` ids in all."""

    def __init__(self, max_tokens: int = CACHE_TOKENS) -> None:
        self._max = max_tokens
        self._roots: dict[Splitter, Piece] = {}
        self._used: OrderedDict[Piece, None] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._used)

    def root(self, splitter: Splitter) -> Piece:
        """The empty start of every prompt that ``splitter`` cuts (one tokenizer's)."""
        found = self._roots.get(splitter)
        if found is None:
            found = self._roots[splitter] = Piece("", (), 0, None)
        return found

    def after(self, piece: Piece, text: str, at: int, ends: EndsAt) -> Piece | None:
        """The cached piece after ``piece`` that ``text`` goes on with at ``at``, if any (``ends``: whether a cut
        of the piece's own text is one in ``text`` too)."""
        for children in (piece.after_short, piece.after.get(text[at : at + PROBE])):
            for child in children or ():
                if text.startswith(child.text, at) and ends(text, at + len(child.text), child.special):
                    return child
        return None

    def add(self, parent: Piece, text: str, ids: tuple[int, ...], special: int) -> Piece | None:
        """Cache a piece after ``parent``; None when it is not cached (too big, or ``parent`` was dropped)."""
        if len(ids) > self._max or (parent.parent is not None and parent not in self._used):
            return None
        piece = Piece(text, ids, special, parent)
        if len(text) < PROBE:
            parent.after_short.append(piece)
        else:
            parent.after.setdefault(text[:PROBE], []).append(piece)
        self._used[piece] = None
        self.tokens += len(ids)
        while self.tokens > self._max:
            self._drop(next(iter(self._used)))
        return piece if piece in self._used else None

    def keep_keys(self, piece: Piece, tag: KeysTag, keys: Sequence[int]) -> None:
        """Keep ``keys`` (those of the blocks that end within ``piece``) with it, counted against the cache's size."""
        if piece not in self._used or (piece.keys is not None and tag in piece.keys):
            return
        if piece.keys is None:
            piece.keys = {}
        piece.keys[tag] = tuple(keys)
        self.tokens += KEY_COST * len(keys)
        while self.tokens > self._max:
            self._drop(next(iter(self._used)))

    def used(self, pieces: Sequence[Piece]) -> None:
        """A prompt's pieces were just read, its first piece first: marked used from the last to the first, so
        that a piece is dropped only after every piece after it (which is no use without it)."""
        used, move = self._used, self._used.move_to_end
        for piece in reversed(pieces):
            if piece in used:
                move(piece)

    def _drop(self, piece: Piece) -> None:
        """Forget a piece, and any after it (there are none, unless it was dropped while a prompt went on)."""
        parent = piece.parent
        if parent is not None:
            if piece in parent.after_short:
                parent.after_short.remove(piece)
            else:
                same = parent.after.get(piece.text[:PROBE], [])
                if piece in same:
                    same.remove(piece)
                if not same:
                    parent.after.pop(piece.text[:PROBE], None)
        stack = [piece]
        while stack:
            gone = stack.pop()
            if gone in self._used:
                del self._used[gone]
                kept = sum(map(len, gone.keys.values())) if gone.keys else 0
                self.tokens -= len(gone.ids) + KEY_COST * kept
            gone.keys = None
            stack += gone.children()
            gone.after, gone.after_short = {}, []


def _share(size: int) -> None:
    with _GROWING:  # tokenizers load in threads: two growing it at once would put ints out of place
        if len(_INTS) < size:
            _INTS.extend(range(len(_INTS), size))


def token_ids(tokenizer: Tokenizer, text: str, special: bool = False) -> list[int]:
    """``text``'s ids (``special``: with the tokenizer's special tokens added). ``encode_batch_fast`` of one text
    gives ``encode``'s ids without working out the offsets of each token, which routing never reads: 35-40% less
    CPU for a piece of 150-1,000 tokens (the bench's tokenizer, all threads counted)."""
    return tokenizer.encode_batch_fast([text], add_special_tokens=special)[0].ids


def _shared(ids: list[int]) -> tuple[int, ...]:
    try:
        return tuple(map(_INTS.__getitem__, ids))
    except IndexError:  # an id past the vocabulary's size: no tokenizer gives one, but keep it as it is
        return tuple(ids)


class Splitter:
    """Where a rendered chat may be cut for ``tokenizer`` (module docstring): after its special tokens
    (``hard``) and at word starts (``soft``)."""

    def __init__(self, tokenizer: Tokenizer, *, hard: bool = True, soft: bool = True) -> None:
        self._tokenizer = tokenizer
        added = list(tokenizer.get_added_tokens_decoder().values())
        # A token that strips the whitespace after it would take some of the tail: never cut after one.
        specials = {t.content for t in added if t.special and t.content and not t.rstrip}
        alternatives = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
        self._hard = re.compile(alternatives) if hard and alternatives else None
        # A word start inside an added token's text, or beside a token that strips the whitespace next to it, is
        # not where the tokenizer begins a piece.
        self._soft = soft and not any(t.lstrip or t.rstrip or any(c.isspace() for c in t.content) for t in added)
        _share(tokenizer.get_vocab_size(with_added_tokens=True))

    @classmethod
    def checked(cls, tokenizer: Tokenizer, samples: Sequence[str]) -> Splitter | None:
        """A splitter with the kinds of cut that give the ids of the whole text at every cut of every sample, or
        None when neither does (or no sample has a cut to try)."""
        probe = cls(tokenizer)
        hard = probe._clean(samples, probe._hard_cuts)
        soft = probe._soft and probe._clean(samples, lambda text: [m.start() for m in _WORD_START.finditer(text)])
        return cls(tokenizer, hard=hard, soft=soft) if hard or soft else None

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("hard",) * (self._hard is not None) + ("soft",) * self._soft

    def _clean(self, samples: Sequence[str], cuts_of: _CutsOf) -> bool:
        cut = [(text, cuts_of(text)) for text in samples]
        return any(cuts for _, cuts in cut) and all(
            self.encode(text[:c]) + self.encode(text[c:]) == self.encode(text) for text, cuts in cut for c in cuts
        )

    def _hard_cuts(self, text: str) -> list[int]:
        return [m.end() for m in self._hard.finditer(text)] if self._hard else []

    def cuts(self, text: str, start: int = 0) -> list[tuple[int, int]]:
        """Where ``text`` is cut after ``start`` (a cut itself), in order: after each special token, and between two
        of them (or the ends) at the first word start past ``FIRST_CUT`` characters, then past every ``SOFT_CUT``.
        Each cut with the length of the special token it follows (0: it is a word start)."""
        hard = [(m.end(), m.end() - m.start()) for m in self._hard.finditer(text, start)] if self._hard else []
        if not self._soft:
            return hard
        cuts: list[tuple[int, int]] = []
        for end, special in (*hard, (len(text), 0)):
            at = start + FIRST_CUT
            while at < end and (found := _WORD_START.search(text, at, end)) is not None:
                cuts.append((found.start(), 0))
                at = found.start() + SOFT_CUT
            cuts.append((end, special))
            start = end
        cuts.pop()  # the end of the text
        return cuts

    def ends_at(self, text: str, end: int, special: int) -> bool:
        """Whether ``text`` is cut at ``end`` as another text that is the same up to there was (``special``: the
        length of the special token it ended with there; 0: before a word)."""
        if not special:
            return _WORD_START.match(text, end) is not None
        found = self._hard.match(text, end - special) if self._hard else None
        return found is not None and found.end() == end  # not the start of a longer special token

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` tokenized whole, no special tokens added."""
        return token_ids(self._tokenizer, text)

    def piece(self, text: str) -> tuple[int, ...]:
        """The ids of a piece of text (between two cuts), as they are cached."""
        return _shared(token_ids(self._tokenizer, text))


class _CutsOf(Protocol):
    def __call__(self, text: str, /) -> list[int]: ...


class ChatIds:
    """A rendered chat's ids (no special tokens added), worked out piece by piece as far as they are asked for.

    The pieces an earlier prompt of the same tokenizer began with are read from ``cache`` at once
    (``reused``); the others are tokenized when ``head`` or ``whole`` needs them, and cached, except the last
    piece (the next turn's text goes on from it, so it is not cut there).
    """

    __slots__ = (
        "_splitter",
        "_cache",
        "_text",
        "_length",
        "_node",
        "_pieces",
        "_cuts",
        "_done",
        "_at",
        "_ids",
        "_counts",
        "_path",
        "_keyed",
        "reused",
    )

    def __init__(self, splitter: Splitter, cache: PrefixIds, text: str, counts: tuple[Count, Count]) -> None:
        self._splitter, self._cache, self._text, self._length = splitter, cache, text, len(text)
        self._node: Piece | None = cache.root(splitter)
        """The last piece worked out, where the next is cached (None: it could not be, nor can what follows)."""
        self._pieces: list[Piece] = []
        self._ids: list[int] = []
        self._counts = counts
        """(tokenized, reused) ids."""
        self._at = 0
        """Characters of the text whose ids are known."""
        self.reused = 0
        self._path: list[tuple[Piece, int]] = []
        """The prompt's cached pieces from its start, each with the ids up to its end: where its block keys are read
        and kept, so held until the request ends (a piece the cache drops meanwhile lives until then)."""
        self._keyed: dict[KeysTag, int] = {}
        """Pieces of ``_path`` from the start that held their keys for a tag when ``known_keys`` read them."""
        self._read_cached()
        if not text.isascii():
            # A lone surrogate (Python's json lets one through) is no text a tokenizer reads: refused here, where
            # the caller expects errors, not later when routing asks for the ids.
            text[self._at :].encode()
        self._cuts = splitter.cuts(text, self._at)
        self._done = 0
        """Pieces worked out since the cached ones (the last one ends at the end of the text)."""
        if self.reused:
            counts[1].inc(self.reused)
            cache.used(self._pieces)

    @property
    def pieces(self) -> int:
        """The pieces the text is cut into."""
        return len(self._pieces) + len(self._cuts) + 1

    @property
    def complete(self) -> bool:
        """Whether every id is known."""
        return self._at == self._length

    def head(self, count: int) -> list[int]:
        """At least the first ``count`` ids, or all of them when the prompt has fewer."""
        if len(self._ids) < count and not self.complete:
            known = len(self._ids)
            while len(self._ids) < count and not self.complete:
                self._next()
            self._counts[0].inc(len(self._ids) - known)
            self._cache.used(self._pieces)
            if self.complete:
                self._text, self._pieces = "", []  # a request may stream for minutes: keep only its ids
        return self._ids

    def whole(self) -> list[int]:
        return self.head(sys.maxsize)

    def about(self) -> int:
        """About as many as the ids of the whole text (exactly, once ``complete``): those known, and the rest of
        the text at as many ids a character as the part known."""
        known = len(self._ids)
        if self.complete or not self._at:
            return known if self.complete else self._length  # nothing known yet: one a character at most
        return known + round((self._length - self._at) * known / self._at)

    def known_keys(self, tag: KeysTag) -> list[int]:
        """The keys for ``tag`` of the prompt's first blocks that earlier prompts left with its cached pieces: those
        of the pieces from the start up to the first one that has none."""
        found: list[int] = []
        pieces = 0
        for piece, _ in self._path:
            kept = piece.keys.get(tag) if piece.keys is not None else None
            if kept is None:
                break
            found += kept
            pieces += 1
        self._keyed[tag] = pieces
        return found

    def keep_keys(self, tag: KeysTag, keys: Sequence[int]) -> None:
        """``keys`` (for ``tag``, of the prompt's first blocks) are kept with the cached pieces whose blocks they
        all cover, for later prompts that begin the same."""
        size, first = tag[0], self._keyed.get(tag, 0)  # the pieces before ``first`` hold them already
        start = self._path[first - 1][1] if first else 0
        for piece, end in self._path[first:]:
            if end // size > len(keys):
                break
            self._cache.keep_keys(piece, tag, keys[start // size : end // size])
            start, first = end, first + 1
        self._keyed[tag] = first

    def _read_cached(self) -> None:
        """Walk down the cache as far as the text goes on as earlier prompts did."""
        cache, text, ends, pieces, ids = self._cache, self._text, self._splitter.ends_at, self._pieces, self._ids
        node, at = self._node, 0
        while node is not None and (found := cache.after(node, text, at, ends)) is not None:
            pieces.append(found)
            ids += found.ids
            self._path.append((found, len(ids)))
            node, at = found, at + len(found.text)
        self._node, self._at, self.reused = node, at, len(ids)

    def _next(self) -> None:
        """Tokenize the next piece (nothing after the cached ones is cached: ``_read_cached`` went as far as it
        could), and cache it unless it is the last."""
        if self._done == len(self._cuts):
            self._ids += self._splitter.piece(self._text[self._at :])
            self._at, self._done = self._length, self._done + 1
            return
        end, special = self._cuts[self._done]
        text = self._text[self._at : end]
        ids = self._splitter.piece(text)
        self._ids += ids
        if self._node is not None:
            self._node = self._cache.add(self._node, text, ids, special)
            if self._node is not None:
                self._pieces.append(self._node)
                self._path.append((self._node, len(self._ids)))
        self._at, self._done = end, self._done + 1
