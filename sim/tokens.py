"""The simulated model: a word tokenizer, a chat template and a deterministic "language model".

Tokenizer. Text is split on whitespace; each word is one token id in ``[0, VOCAB_SIZE)``:
- the special words ``<|user|>``, ``<|assistant|>``, ... are their own ids (``SPECIALS``);
- ``tok<N>`` (canonical digits, ``N >= FIRST_GENERATED``) is id N: every id has this text, so
  ``encode(decode(ids)) == ids``;
- any other word hashes (BLAKE2b, stable across processes, unlike ``hash()``) into the prompt range
  ``[FIRST_PROMPT, VOCAB_SIZE)``.
A token's text is its word with a leading space, so concatenated output re-tokenizes to the same ids
(``" tok17 tok902"``), whether it is appended to a prompt's text or sent as a partial assistant message.

Chat template. Each message renders as ``<|role|> content... <|end|>``; ``add_generation_prompt`` appends
``<|assistant|>``; ``continue_final_message`` leaves the last message open (no ``<|end|>``). Hence
``render(msgs + [partial assistant], continue) == render(msgs, add_generation_prompt) + encode(partial)``.

Generation. The next token is a pure function of the whole context (prompt ids + ids generated so far): a
64-bit FNV-1a hash folded over every id, mixed, mapped into the generated range
``[FIRST_GENERATED, FIRST_PROMPT)``. The answer so far is the run of generated-range ids at the end of the
context (after ``<|assistant|>`` in a chat, or a completion prompt that ends with generated text); EOS
(finish_reason "stop") comes when that run reaches ``output_len`` (at least 1), unless max_tokens comes first
("length", checked first). ``ignore_eos`` with max_tokens generates exactly max_tokens. Both rules depend only
on the context, so a continuation (prompt + first k tokens, max_tokens - k) yields exactly the rest of the
answer with the same finish_reason, given the same ``output_len``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from hashlib import blake2b

VOCAB_SIZE = 32768
FIRST_GENERATED = 16
"""Ids below are special tokens."""
FIRST_PROMPT = 4096
"""Generated tokens come from [FIRST_GENERATED, FIRST_PROMPT); other words hash into [FIRST_PROMPT, VOCAB_SIZE)."""

_NAMED = ("<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|developer|>", "<|role|>")
SPECIALS = _NAMED + tuple(f"<|reserved_{i}|>" for i in range(len(_NAMED), FIRST_GENERATED))
"""Special tokens by id; ``<|role|>`` precedes the name of a role without a marker of its own."""
_SPECIAL_IDS = {text: i for i, text in enumerate(SPECIALS)}
END = _SPECIAL_IDS["<|end|>"]
ASSISTANT = _SPECIAL_IDS["<|assistant|>"]
OTHER_ROLE = _SPECIAL_IDS["<|role|>"]

_CANONICAL = re.compile(r"tok([1-9][0-9]*)")
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


# ---- tokenizer ----


@lru_cache(maxsize=1 << 16)
def word_id(word: str) -> int:
    """The id of one whitespace-free word."""
    special = _SPECIAL_IDS.get(word)
    if special is not None:
        return special
    match = _CANONICAL.fullmatch(word)
    if match and len(word) <= 8 and FIRST_GENERATED <= int(match.group(1)) < VOCAB_SIZE:
        return int(match.group(1))
    digest = blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return FIRST_PROMPT + int.from_bytes(digest, "big") % (VOCAB_SIZE - FIRST_PROMPT)


def encode(text: str) -> list[int]:
    return [word_id(word) for word in text.split()]


def word(token: int) -> str:
    """The word of an id in [0, VOCAB_SIZE): a special token's, or ``tok<id>``."""
    return SPECIALS[token] if token < FIRST_GENERATED else f"tok{token}"


def token_text(token: int) -> str:
    """What one generated token adds to the output text."""
    return " " + word(token)


def decode(tokens: Iterable[int]) -> str:
    return "".join(token_text(t) for t in tokens)


def in_vocab(token: object) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and 0 <= token < VOCAB_SIZE


# ---- chat template ----


_ROLE_MARKERS = {role: _SPECIAL_IDS[f"<|{role}|>"] for role in ("system", "user", "assistant", "tool", "developer")}


Encoder = Callable[[str], list[int]]
"""Text -> ids: ``encode`` here, or a Hugging Face tokenizer's (``vocab.HfVocab.encode``)."""


def _role_ids(role: str, encoder: Encoder) -> list[int]:
    marker = _ROLE_MARKERS.get(role)
    return [marker] if marker is not None else [OTHER_ROLE, *encoder(role)]


def render_chat(
    messages: Sequence[tuple[str, str]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    encoder: Encoder = encode,
) -> list[int]:
    """Token ids of ``(role, text)`` messages; the caller has rejected both flags set."""
    ids: list[int] = []
    last = len(messages) - 1
    for i, (role, text) in enumerate(messages):
        ids += _role_ids(role, encoder)
        ids += encoder(text)
        if not (continue_final_message and i == last):
            ids.append(END)
    if add_generation_prompt:
        ids.append(ASSISTANT)
    return ids


# ---- the language model ----


def _absorb(state: int, token: int) -> int:
    return ((state ^ token) * _FNV_PRIME) & _MASK


def _next_token(state: int) -> int:
    # splitmix64's finalizer: FNV's low bits alone would repeat with short periods.
    z = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    z ^= z >> 31
    return FIRST_GENERATED + z % (FIRST_PROMPT - FIRST_GENERATED)


def is_generated(token: int) -> bool:
    return FIRST_GENERATED <= token < FIRST_PROMPT


def answer_so_far(context: Sequence[int]) -> int:
    """Length of the trailing run of generated-range ids: the part of the answer already in the context."""
    run = 0
    for token in reversed(context):
        if not is_generated(token):
            break
        run += 1
    return run


@dataclass(frozen=True, kw_only=True)
class Answer:
    tokens: tuple[int, ...]
    finish_reason: str
    """"stop" (EOS) or "length" (max_tokens)."""


def complete(prompt: Sequence[int], *, max_tokens: int | None, output_len: int, ignore_eos: bool = False) -> Answer:
    """The greedy answer to ``prompt`` (see the module docstring for the rule)."""
    state = _FNV_OFFSET
    for token in prompt:
        state = _absorb(state, token)
    run = answer_so_far(prompt)
    eos_at = None if ignore_eos and max_tokens is not None else max(1, output_len)
    tokens: list[int] = []
    while True:
        if max_tokens is not None and len(tokens) >= max_tokens:
            return Answer(tokens=tuple(tokens), finish_reason="length")
        if eos_at is not None and run >= eos_at:
            return Answer(tokens=tuple(tokens), finish_reason="stop")
        token = _next_token(state)
        tokens.append(token)
        state = _absorb(state, token)
        run += 1
