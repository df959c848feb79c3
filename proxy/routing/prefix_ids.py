"""A chat's token ids, worked out piece by piece, reusing the pieces that earlier prompts began with.

Tokenizers restart at special tokens (added tokens are split out before anything else runs), and their
pre-tokenizers begin a new piece before a word (`` word``: byte-level BPE's regex, WordPiece's whitespace split and
SentencePiece's Metaspace alike). So a text *cut* right after a special token, or before a space that follows a
non-space and precedes a letter, tokenizes as its two sides do, for tokenizers that treat the start of a text
like any other place. ``Splitter.checked`` tries both kinds of cut on the model's own tokenizer and template and
keeps those that hold (neither: chats are tokenized whole). A rendered chat is cut after every special token and,
in a longer run of text, at the first word start past every ``SOFT_CUT`` characters.

``ChatIds`` works a rendered chat out piece by piece, only as far as the router asks (when no node holds the
start of a prompt, the rest of it cannot be a hit, kvchoice.py), and keeps each piece's ids in ``PrefixIds``
under a hash of the text up to the piece's end. A later prompt that begins with the same text -- the next turn,
or another conversation with the same preamble, tool list or document -- reads those pieces back and tokenizes
only what follows. Tokenizing in pieces is cheaper even when nothing is reused: the tokenizers library's cost
per token grows with the length of the text it is given (bench/README.md).
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer

CACHE_TOKENS = 4_000_000
"""Ids held by the prefix cache of one replica, over all models (8 bytes each: the ints are shared)."""
SOFT_CUT = 4096
"""Characters of text at least between two cuts at word starts: about a thousand tokens, which a replica
tokenizes in under a millisecond, where a piece read from the cache costs it about a microsecond."""

_WORD_START = re.compile(r"(?<=\S) (?=[^\W\d_])")
"""A space between a non-space and a letter: where a soft cut goes (the space starts the next piece)."""
_INTS: list[int] = []
"""One int object per token id, shared by every piece cached: 8 bytes per id cached instead of 36."""


class Count(Protocol):
    """What ``ChatIds`` counts ids on (a Prometheus counter's child)."""

    def inc(self, amount: float = 1) -> None: ...


class PrefixIds:
    """Pieces' ids by the key of the text up to their end, least recently used first out, holding at most
    ``max_tokens`` ids in all."""

    def __init__(self, max_tokens: int = CACHE_TOKENS) -> None:
        self._max = max_tokens
        self._entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: int) -> tuple[int, ...] | None:
        return self._entries.get(key)

    def put(self, key: int, ids: tuple[int, ...]) -> None:
        if key in self._entries or len(ids) > self._max:
            return
        self._entries[key] = ids
        self.tokens += len(ids)
        while self.tokens > self._max:
            _, old = self._entries.popitem(last=False)
            self.tokens -= len(old)

    def used(self, keys: Sequence[int]) -> None:
        """A prompt's pieces were just read, its first piece first: marked used from the last to the first, so
        that a piece stays at least as long as every piece after it (which is no use without it)."""
        move = self._entries.move_to_end
        for key in reversed(keys):
            try:
                move(key)
            except KeyError:  # evicted meanwhile
                pass


def _share(size: int) -> None:
    if len(_INTS) < size:
        _INTS.extend(range(len(_INTS), size))


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

    def cuts(self, text: str) -> list[int]:
        """Where ``text`` is cut, in order: after each special token, and between two of them (or the ends) at
        the first word start past every ``SOFT_CUT`` characters."""
        hard = self._hard_cuts(text)
        if not self._soft:
            return hard
        cuts: list[int] = []
        start = 0
        for end in (*hard, len(text)):
            at = start + SOFT_CUT
            while at < end and (found := _WORD_START.search(text, at, end)) is not None:
                cuts.append(found.start())
                at = found.start() + SOFT_CUT
            cuts.append(end)
            start = end
        cuts.pop()  # the end of the text
        return cuts

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` tokenized whole, no special tokens added."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def piece(self, text: str) -> tuple[int, ...]:
        """The ids of a piece of text (between two cuts), as they are cached."""
        return _shared(self._tokenizer.encode(text, add_special_tokens=False).ids)


class _CutsOf(Protocol):
    def __call__(self, text: str, /) -> list[int]: ...


class ChatIds:
    """A rendered chat's ids (no special tokens added), worked out piece by piece as far as they are asked for.

    A piece that an earlier prompt had (the same text from the start of the prompt to the piece's end, for the
    same tokenizer: ``salt``) is read from ``cache``; any other is tokenized and cached, except the last piece
    (the next turn's text goes on from it, so it is not cut there). The cached pieces from the start are read
    at once (``reused``); the rest only when ``head`` or ``whole`` needs them.
    """

    __slots__ = (
        "_splitter",
        "_cache",
        "_text",
        "_length",
        "_cuts",
        "_done",
        "_at",
        "_key",
        "_keys",
        "_ids",
        "_counts",
        "reused",
    )

    def __init__(self, splitter: Splitter, cache: PrefixIds, salt: int, text: str, counts: tuple[Count, Count]) -> None:
        self._splitter, self._cache, self._text, self._length = splitter, cache, text, len(text)
        self._cuts = splitter.cuts(text)
        self._done = 0
        """Pieces worked out (a piece ends at ``_cuts[i]``, the last one at the end of the text)."""
        self._at = 0
        """Characters of the text whose ids are known."""
        self._key = salt
        self._keys: list[int] = []
        self._ids: list[int] = []
        self._counts = counts
        """(tokenized, reused) ids."""
        self.reused = 0
        self._read_cached()
        if self.reused:
            counts[1].inc(self.reused)
            cache.used(self._keys)

    @property
    def pieces(self) -> int:
        return len(self._cuts) + 1

    @property
    def complete(self) -> bool:
        """Whether every id is known."""
        return self._at == self._length

    def head(self, count: int) -> list[int]:
        """At least the first ``count`` ids, or all of them when the prompt has fewer."""
        if len(self._ids) < count and not self.complete:
            known, reused = len(self._ids), self.reused
            while len(self._ids) < count and not self.complete:
                self._next()
            self._counts[0].inc(len(self._ids) - known - (self.reused - reused))
            if self.reused > reused:
                self._counts[1].inc(self.reused - reused)
            self._cache.used(self._keys)
            if self.complete:
                self._text, self._keys = "", []  # a request may stream for minutes: keep only its ids
        return self._ids

    def whole(self) -> list[int]:
        return self.head(sys.maxsize)

    def _read_cached(self) -> None:
        """The pieces the cache has, from the start (in one loop: a long prompt has a hundred or more)."""
        text, get, ids, keys = self._text, self._cache.get, self._ids, self._keys
        key, at = self._key, 0
        for end in self._cuts:
            next_key = hash((key, text[at:end]))
            found = get(next_key)
            if found is None:
                break
            ids += found
            keys.append(next_key)
            key, at = next_key, end
        self._key, self._at, self._done, self.reused = key, at, len(keys), len(ids)

    def _next(self) -> None:
        """Work out the next piece: from the cache when it has it, else by tokenizing it."""
        if self._done == len(self._cuts):  # the last piece: tokenized, never cached
            self._ids += self._splitter.piece(self._text[self._at :])
            self._at, self._done = self._length, self._done + 1
            return
        end = self._cuts[self._done]
        key = hash((self._key, self._text[self._at : end]))
        ids = self._cache.get(key)
        if ids is None:
            ids = self._splitter.piece(self._text[self._at : end])
            self._cache.put(key, ids)
        else:
            self.reused += len(ids)
        self._ids += ids
        self._key = key
        self._keys.append(key)
        self._at, self._done = end, self._done + 1
