"""What turning a chat into token ids costs a replica (proxy/kvcache/prompt/tokens.py, prefix_ids.py): CPU per request
in the cases a replica meets all day.

- **new, nothing shared**: a conversation's first turn whose start no node holds (every conversation has a
  system preamble of its own), for which routing asks only for its first ``kv_aware.HEAD_TOKENS`` ids;
- **new, shared start**: a first turn that shares all but its first user message (``--first-words``) with
  conversations tokenized before (one system preamble for all): routing asks for all its ids;
- **next turn**: turns 2+ of those conversations (the previous turn plus an answer and a user message);
- **after new, nothing shared**: the second turn of a conversation whose first turn was read only in part: it
  pays for the rest of that turn (a node holds its start by then).

    python -m bench.tokenize_cost [--conversations 8] [--system-words 900] [--first-words 1700]
        [--tokenizer NAME=DIR ...] [--json]

Every request also goes through an instance that tokenizes each chat whole and reuses nothing
(``cache_tokens=0``: the cost of every new conversation before ids were worked out in pieces), and the two must
agree (for a first turn read in part, with the whole's first ids). Conversation 0 of those sharing a start warms
the cache first, as some node's conversation would (its turns are also the ones checked against tokenizing
whole, ``tokens.CHECKED_SPLITS``). CPU is the calling thread's (``time.thread_time``) around each request's
rendering, tokenizing and cache reads; p50 per case. Two tokenizers: the simulator's (``vllm-sim --tokenizer``:
WordPiece, words split on whitespace) and a byte-level BPE with a ChatML template trained here on the same words
(the kind of tokenizer Llama 3 or Qwen models have, smaller vocabulary); ``--tokenizer`` adds a model's own.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from vllm_etcd_proxy.proxy.kvcache.prompt.ids import KvPrompt
from vllm_etcd_proxy.proxy.kvcache.prompt.prefix_ids import ChatIds
from vllm_etcd_proxy.proxy.kvcache.prompt.tokens import PromptTokens
from vllm_etcd_proxy.proxy.routing.kv_aware import HEAD_TOKENS
from vllm_etcd_proxy.sim import tokens, vocab

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>"
    "\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CASES = ("new, nothing shared", "new, shared start", "next turn", "after new, nothing shared")
Body = dict[str, Any]
T = TypeVar("T")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tokenize_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8, help="conversations of each kind (8)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=900, help="system preamble (900)")
    p.add_argument("--first-words", type=int, default=1700, help="words of a conversation's first message (1700)")
    p.add_argument("--user-words", type=int, default=120, help="words per later user message (120)")
    p.add_argument("--answer-tokens", type=int, default=64, help="generated tokens per answer (64)")
    p.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also a tokenizer directory of your own (tokenizer.json, tokenizer_config.json with a chat template)",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = p.parse_args(argv)
    counts = (args.conversations, args.system_words, args.first_words, args.user_words, args.answer_tokens)
    if min(counts) < 1 or args.turns < 2:
        p.error("every count must be at least 1, --turns at least 2")
    if any("=" not in t for t in args.tokenizer):
        p.error("--tokenizer takes NAME=DIR")
    return args


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(vocab.WORDS) for _ in range(count))


def conversation(args: argparse.Namespace, name: str, system: str) -> list[Body]:
    """A conversation's request bodies, turn by turn."""
    rng = random.Random(f"conversation {name}")
    tag = hashlib.blake2b(name.encode(), digest_size=4).hexdigest()
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    bodies = []
    for turn in range(args.turns):
        if turn == 0:
            messages.append({"role": "user", "content": f"session {tag}: {words(rng, args.first_words)}"})
        else:
            messages.append({"role": "user", "content": words(rng, args.user_words)})
        bodies.append({"model": "m", "messages": list(messages)})
        answer = [rng.randrange(tokens.FIRST_GENERATED, tokens.FIRST_PROMPT) for _ in range(args.answer_tokens)]
        messages.append({"role": "assistant", "content": tokens.decode(answer).lstrip()})
    return bodies


def workload(args: argparse.Namespace) -> tuple[list[list[Body]], list[list[Body]]]:
    """(conversations each with a preamble of its own, conversations sharing one preamble: one more, to warm)."""
    system = words(random.Random("system"), args.system_words)
    shared = [conversation(args, f"shared {c}", system) for c in range(args.conversations + 1)]
    own = [
        conversation(args, f"own {c}", f"agent {c}: " + words(random.Random(f"system {c}"), args.system_words))
        for c in range(args.conversations)
    ]
    return own, shared


def chatml_bpe(directory: Path) -> Path:
    """A byte-level BPE (8,000 ids) trained on the benchmark's words, with a ChatML template."""
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    rng = random.Random("corpus")
    corpus = [words(rng, 50) + f" {rng.randrange(1 << 32):x} " + tokens.decode(range(16, 4096, 7)) for _ in range(400)]
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def ready(source: Path, cache: bool) -> PromptTokens:
    tokens_ = PromptTokens({"m": str(source)}, lambda model: [], CollectorRegistry(), cache_tokens=4_000_000 * cache)
    tokens_.start()
    deadline = time.monotonic() + 30
    while tokens_.prompt_ids("m", {"prompt": "x"}, "completion") is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"the tokenizer in {source} did not load")
        time.sleep(0.01)
    return tokens_


def cpu_of(work: Callable[[], T]) -> tuple[float, T]:
    start = time.thread_time()
    result = work()
    return time.thread_time() - start, result


Request = tuple[str | None, Body, bool]
"""(case, or None for a warm-up request; body; whether routing asks only for the first ids)."""


def requests(own: list[list[Body]], shared: list[list[Body]]) -> list[Request]:
    """The workload in the order a replica gets it: the warm-up conversation, then every case."""
    out: list[Request] = [(None, body, False) for body in shared[0]]
    for bodies in own:
        out += [(CASES[0], bodies[0], True), (CASES[3], bodies[1], False)]
    for bodies in shared[1:]:
        out += [(CASES[1], bodies[0], False), *((CASES[2], body, False) for body in bodies[1:])]
    return out


def in_pieces(source: Path, workload: list[Request]) -> list[tuple[float, list[int], int, float]]:
    """Each request on a replica's instance (pieces cached): (CPU, ids, ids tokenized rather than reused, CPU of
    its block keys at block 16 afterwards, going on from those that earlier prompts left with the pieces)."""
    replica = ready(source, True)
    out = []
    try:
        for _, body, head in workload:

            def ids(body: Body = body, head: bool = head) -> tuple[list[int], int, ChatIds]:
                found = replica.ids("m", body, "chat")
                if not isinstance(found, ChatIds):
                    raise SystemExit(f"{source}: a chat was not read in pieces")
                return list(found.head(HEAD_TOKENS + 1) if head else found.whole()), found.reused, found

            spent, (got, reused, found) = cpu_of(ids)
            keys = functools.partial(KvPrompt(found, "m").keys, 16, within=HEAD_TOKENS if head else None)
            keys_spent, _ = cpu_of(keys)
            out.append((spent, got, len(got) - reused, keys_spent))
    finally:
        replica.close()
    return out


def whole(source: Path, workload: list[Request]) -> list[tuple[float, list[int]]]:
    """Each request tokenized whole, nothing reused: (CPU, ids)."""
    reference = ready(source, False)
    out = []
    try:
        for _, body, _ in workload:

            def ids(body: Body = body) -> list[int] | None:
                return reference.prompt_ids("m", body, "chat")

            spent, got = cpu_of(ids)
            if got is None:
                raise SystemExit(f"{source}: a chat gave no ids")
            out.append((spent, got))
    finally:
        reference.close()
    return out


def measure(source: Path, own: list[list[Body]], shared: list[list[Body]]) -> dict[str, Any]:
    """The workload in pieces, then whole (one pass after the other: neither leaves the other cold caches)."""
    workload = requests(own, shared)
    samples: dict[str, list[tuple[float, float, int, int, float]]] = {case: [] for case in CASES}
    """case -> (CPU in pieces, CPU whole, the prompt's tokens, tokens tokenized in pieces, CPU of its keys)."""
    for (case, _, head), (spent, ids, tokenized, keys_spent), (spent_whole, ids_whole) in zip(
        workload, in_pieces(source, workload), whole(source, workload), strict=True
    ):
        if ids != ids_whole[: len(ids)] or not (head or len(ids) == len(ids_whole)):
            raise SystemExit(f"{source}: the ids in pieces differ from tokenizing whole ({case})")
        if case is not None:
            samples[case].append((spent, spent_whole, len(ids_whole), tokenized, keys_spent))

    def p50(values: list[float]) -> float:
        return round(statistics.median(values) * 1e6, 1)

    report: dict[str, Any] = {
        case: {
            "tokens": round(statistics.median(s[2] for s in rows)),
            "tokenized": round(statistics.median(s[3] for s in rows)),
            "pieces_us": p50([s[0] for s in rows]),
            "whole_us": p50([s[1] for s in rows]),
            "keys_us": p50([s[4] for s in rows]),
        }
        for case, rows in samples.items()
    }
    # What the index's block keys of the last prompt cost (kvcache.index.chain, block 16): not counted above.
    last = whole(source, workload[-1:])[0][1]
    report["keys_us"] = p50([cpu_of(lambda: KvPrompt(last, "m").keys(16))[0] for _ in range(5)])
    report["keys_tokens"] = len(last)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    own, shared = workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        sources = {
            "vllm-sim (WordPiece)": vocab.write(Path(tmp) / "sim"),
            "ChatML byte-level BPE": chatml_bpe(Path(tmp) / "bpe"),
            **{name: Path(path) for name, path in (t.split("=", 1) for t in args.tokenizer)},
        }
        report = {name: measure(source, own, shared) for name, source in sources.items()}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.conversations} conversations of each kind x {args.turns} turns; CPU per request, p50 (us)")
    print(f"{'tokenizer':22} {'case':26} {'tokens':>7} {'tokenized':>9} {'in pieces':>10} {'whole':>9} {'keys':>8}")
    for name, rows in report.items():
        for case in CASES:
            row = rows[case]
            print(
                f"{name if case == CASES[0] else '':22} {case:26} {row['tokens']:>7} {row['tokenized']:>9} "
                f"{row['pieces_us']:>10} {row['whole_us']:>9} {row['keys_us']:>8}"
            )
        print(f"{'':22} {'(block keys, nothing kept)':26} {rows['keys_tokens']:>7} {'':>9} {'':>10} {'':>9} ", end="")
        print(f"{rows['keys_us']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
