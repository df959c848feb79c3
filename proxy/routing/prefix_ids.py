"""Token ids of a chat's rendered text without tokenizing its earlier turns again.

Turn N+1 of a conversation renders to turn N's text plus a tail. Tokenizers restart at special tokens (added
tokens are split out before anything else runs), so the ids of the text up to the end of a special token, a
*cut*, followed by the ids of the rest are the ids of the whole, for tokenizers whose pre-tokenizer does not
treat the start of a text specially. ``Splitter.cleanly`` checks that on the model's own tokenizer and template;
where it fails, chats are tokenized whole. ``PrefixIds`` remembers the ids up to the last cut of each prompt,
keyed by a hash of that text, in an LRU bounded by the ids it holds; the next turn looks up its own cuts from
the longest down and tokenizes only what follows the longest one found.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

from tokenizers import Tokenizer

CACHE_TOKENS = 4_000_000
"""Ids held by the prefix cache of one replica (4 bytes each), over all models."""


class PrefixIds:
    """An LRU of ids by prefix hash, holding at most ``max_tokens`` ids in all."""

    def __init__(self, max_tokens: int = CACHE_TOKENS) -> None:
        self._max = max_tokens
        self._entries: OrderedDict[bytes, array[int]] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> array[int] | None:
        ids = self._entries.get(key)
        if ids is not None:
            self._entries.move_to_end(key)
        return ids

    def put(self, key: bytes, ids: array[int]) -> None:
        if key in self._entries or len(ids) > self._max:
            return
        self._entries[key] = ids
        self.tokens += len(ids)
        while self.tokens > self._max:
            _, old = self._entries.popitem(last=False)
            self.tokens -= len(old)


class Splitter:
    """Where a text may be cut: right after each special token of ``tokenizer``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # A token that strips the whitespace after it would take some of the tail: never cut after one.
        specials = {
            t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content and not t.rstrip
        }
        alternatives = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
        self._pattern = re.compile(alternatives) if alternatives else None

    def cuts(self, text: str) -> list[int]:
        return [m.end() for m in self._pattern.finditer(text)] if self._pattern else []

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def cleanly(self, samples: Sequence[str]) -> bool:
        """Whether tokenizing before and after every cut of each sample gives the ids of the whole."""
        return any(self.cuts(s) for s in samples) and all(
            self.encode(s[:c]) + self.encode(s[c:]) == self.encode(s) for s in samples for c in self.cuts(s)
        )

    def encode_chat(self, text: str, cache: PrefixIds, salt: bytes) -> tuple[list[int], bool]:
        """The ids of ``text`` (no special tokens added) and whether a cached prefix gave part of them; the ids
        up to the last cut are cached under ``salt`` (one per model)."""
        cuts = self.cuts(text)
        if not cuts:
            return self.encode(text), False
        hasher = blake2b(salt, digest_size=16)
        keys, start = [], 0
        for cut in cuts:
            hasher.update(text[start:cut].encode("utf-8", "surrogatepass"))
            keys.append(hasher.copy().digest())
            start = cut
        found = next(((i, ids) for i in range(len(cuts) - 1, -1, -1) if (ids := cache.get(keys[i])) is not None), None)
        head, at = (found[1], cuts[found[0]]) if found else (array("I"), 0)
        if found is None or found[0] < len(cuts) - 1:
            encoding = self._tokenizer.encode(text[at:], add_special_tokens=False)
            tail = encoding.ids
            # The tail's tokens before the last cut: none of them straddles it, as cleanly() checked.
            boundary = cuts[-1] - at
            upto = sum(1 for begin, _ in encoding.offsets if begin < boundary)
            cache.put(keys[-1], head + array("I", tail[:upto]))
        else:
            tail = self.encode(text[at:])
        return head.tolist() + tail, found is not None
