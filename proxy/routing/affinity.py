"""Which conversation a request continues, from the request's own content.

A conversation's later turns repeat its earlier prompt and append to it, so the part of the prompt it keeps
is a prefix. Many conversations also share a preamble (a system prompt, few-shot examples) that says nothing
about which conversation this is. The affinity key is therefore the prompt's first *own* block: the prompt is
read as a chain of blocks (each block's hash covers everything before it), and the key is the block that
follows the deepest *shared* block, one that has been seen followed by different blocks, so by different
conversations. Whatever the preamble's length, the key is the start of the conversation's own part, and every
later turn of the conversation has the same key.

A block ends after a newline, or after ``BLOCK`` bytes without one; a chat message always ends with one. So a
turn's own text forms whole blocks even when it is short, and the unfinished block at the end of a prompt
(which the next turn will continue) is not read.

Each replica learns which blocks are shared from the traffic it sees (a bounded table, no I/O); replicas behind
one balancer see the same preambles, so they agree within a few requests of a new preamble. A session header
(or vLLM's body field ``session_id``) or the body's ``user`` wins over all of this; a ``cache_salt`` is part of
every key, since vLLM shares no cached prefix between salts. Chat messages are read as role and content, in order; text
prompts as UTF-8; token-id prompts as their ids.
"""

from __future__ import annotations

import zlib
from array import array
from typing import Any, NamedTuple

BLOCK = 128
"""Bytes per block: about 30 tokens of text, 16 token ids."""
MAX_BYTES = 512 * 1024
"""Only this much of a prompt is read: beyond it, a preamble is taken to be shared by nothing."""
TABLE_SIZE = 1 << 17
"""Blocks remembered per generation (two generations are kept: the current one and the one before)."""
_SHARED = -1


class PrefixIndex:
    """Block successors seen so far; ``key(prompt)`` as the module docstring says."""

    def __init__(self, table_size: int = TABLE_SIZE) -> None:
        self._size = table_size
        self._new: dict[int, int] = {}
        self._old: dict[int, int] = {}

    def _successor(self, block: int) -> int | None:
        found = self._new.get(block)
        if found is None:
            found = self._old.get(block)
            if found is not None:
                self._new[block] = found
        return found

    def key(self, data: bytes, *, newlines: bool = True) -> int:
        """The hash of the first block after the deepest shared one (or of the first block, or of all of
        ``data`` when it has no whole block). ``newlines``: blocks end after a newline too (text, not ids)."""
        return self.read(data, newlines=newlines).key

    def read(self, data: bytes, *, newlines: bool = True) -> Prefix:
        """The key (see ``key``) and how much of ``data`` this replica has seen before in other requests."""
        data = data[:MAX_BYTES]
        view, size = memoryview(data), len(data)
        crc = adler = 1
        key = previous = known = 0
        start = 0
        while (stop := _block_end(data, start, newlines)) is not None:
            block = view[start:stop]
            crc, adler = zlib.crc32(block, crc), zlib.adler32(block, adler)
            current = (crc << 32) | adler
            seen = None if start == 0 else self._follows(previous, current)
            if seen is None:  # the first block, or the first after a shared one: the key so far
                key = current
                # After a shared block the successor is not kept: it was seen if it had one of its own.
                seen = self._successor(current) is not None
            if seen and known == start:
                known = stop
            previous = current
            start = stop
        if len(self._new) > self._size:
            self._old, self._new = self._new, {}
        if start == 0:
            return Prefix(key=(zlib.crc32(data) << 32) | zlib.adler32(data), known=0, size=size)
        return Prefix(key=key, known=known, size=size)

    def _follows(self, previous: int, current: int) -> bool | None:
        """Note that block ``current`` followed block ``previous``: whether it did in an earlier request too, or
        None when ``previous`` is shared (followed by something else before, or known to be shared)."""
        successor = self._successor(previous)
        if successor is None:
            self._new[previous] = current
            return False
        if successor == current:
            return True
        if successor != _SHARED:
            self._new[previous] = _SHARED
        return None


def _block_end(data: bytes, start: int, newlines: bool) -> int | None:
    """Where the block from ``start`` ends: after a newline within ``BLOCK`` bytes (``newlines``), else after
    ``BLOCK`` bytes; None when no whole block is left (the unfinished one at the end is not read)."""
    limit = start + BLOCK
    newline = data.find(b"\n", start, limit) if newlines else -1
    if newline >= 0:
        return newline + 1
    if limit <= len(data):
        return limit
    return None


class Prefix(NamedTuple):
    """What ``PrefixIndex.read`` found in a prompt."""

    key: int
    """The conversation's affinity key."""
    known: int
    """Bytes at the start of the prompt seen before (so likely in some node's prefix cache)."""
    size: int
    """Bytes read (at most ``MAX_BYTES``)."""


def prompt_bytes(body: dict[str, Any]) -> tuple[bytes, bool] | None:
    """The prompt as the bytes its key is read from (messages as role and content, each ending in a newline;
    text; token ids), and whether newlines end blocks (not in ids)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return _chat_text(messages).encode("utf-8", "surrogatepass"), True
    return _prompt_bytes(body.get("prompt"))


def _chat_text(messages: list[Any]) -> str:
    parts = []
    for message in messages:
        if isinstance(message, dict):
            parts.append(f"{message.get('role')}\x1f")
            parts.extend(_content_texts(message.get("content")))
            parts.append("\n")
    return "".join(parts)


def _content_texts(content: Any) -> list[str]:
    """A message's content as text: a string, or each part's text (an image or audio part: its URL or data)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return []
    texts = []
    for part in content:
        if isinstance(part, dict):
            value = part.get("text") or part.get("image_url") or part.get("input_audio")
            texts.append(value if isinstance(value, str) else repr(value))
    return texts


def _prompt_bytes(prompt: Any) -> tuple[bytes, bool] | None:
    """A completion's ``prompt``: text, or token ids (a batch of one prompt counts as that prompt)."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass"), True
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        try:
            return array("q", prompt).tobytes(), False
        except OverflowError:
            return None
    return None


BYTES_PER_TOKEN = 4
"""A rough size of a text token, to turn bytes into tokens for --pd-min-prompt-tokens."""


class Hints(NamedTuple):
    """What routing takes from a request's content."""

    key: str | None
    """The affinity key: session header, else the body's ``user``, else the prompt's first own block."""
    uncached_tokens: int | None
    """Roughly how many of the prompt's tokens no earlier request had (None: unknown)."""


def route_hints(
    index: PrefixIndex | None, body: dict[str, Any], session: str | None, *, count_uncached: bool = True
) -> Hints:
    """The affinity key and the uncached part of the prompt (``index`` None: no prefix reading at all).
    ``count_uncached`` False: only the key is wanted, so a conversation named by the session header or the
    body's ``user`` is routed without reading its prompt."""
    named = None
    if session:
        named = f"session:{session}"
    elif isinstance(body_session := body.get("session_id"), str) and body_session:
        named = f"session:{body_session}"  # vLLM's own field: the same conversation as the header would name
    elif isinstance(user := body.get("user"), str) and user:
        named = f"user:{user}"
    # vLLM never shares a prefix cache between different salts, so neither do keys.
    salt = body.get("cache_salt")
    salted = f"|salt:{salt}" if isinstance(salt, str) and salt else ""
    found = prompt_bytes(body) if index is not None and (named is None or count_uncached) else None
    if index is None or found is None:
        return Hints(key=named + salted if named else None, uncached_tokens=None)
    prefix = index.read(found[0], newlines=found[1])
    uncached = (prefix.size - prefix.known) // (BYTES_PER_TOKEN if found[1] else 8)
    return Hints(key=(named or f"prefix:{prefix.key:x}") + salted, uncached_tokens=uncached)
