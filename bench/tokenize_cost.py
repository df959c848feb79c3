"""What turning a chat into token ids costs a replica (proxy/routing/tokens.py): CPU per request for a 6-turn
chat of about 2,000 tokens, first turn against later turns that reuse the earlier turns' ids, and the same
later turns tokenized whole.

    python -m bench.tokenize_cost [--conversations 40] [--json]

Each conversation shares one system preamble, starts its first user message with a tag of its own and appends
an answer and a user message per turn. Every request goes through ``PromptTokens.prompt_ids`` twice: once on a
replica's instance (the prefix cache on) and once on an instance without the cache; CPU is the calling thread's
(``time.thread_time``) around each call, and the two results must be the same ids. Two tokenizers: the
simulator's (``vllm-sim --tokenizer``: WordPiece, words split on whitespace) and a byte-level BPE with a ChatML
template trained here on the same words (the kind of tokenizer Llama 3 or Qwen models have, smaller vocabulary).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from vllm_etcd_proxy.proxy.routing.tokens import PromptTokens
from vllm_etcd_proxy.sim import tokens, vocab

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>"
    "\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tokenize_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=40, help="conversations of --turns turns each (40)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=900, help="shared system preamble (900)")
    p.add_argument("--user-words", type=int, default=120, help="words per user message (120)")
    p.add_argument("--answer-tokens", type=int, default=64, help="generated tokens per answer (64)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = p.parse_args(argv)
    if min(args.conversations, args.turns, args.system_words, args.user_words, args.answer_tokens) < 1:
        p.error("every count must be at least 1")
    return args


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(vocab.WORDS) for _ in range(count))


def conversations(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """Each conversation's request bodies, turn by turn."""
    system = words(random.Random("system"), args.system_words)
    out = []
    for c in range(args.conversations):
        rng = random.Random(f"conversation {c}")
        tag = hashlib.blake2b(str(c).encode(), digest_size=4).hexdigest()
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        bodies = []
        for turn in range(args.turns):
            text = words(rng, args.user_words)
            messages.append({"role": "user", "content": f"session {tag}: {text}" if turn == 0 else text})
            bodies.append({"model": "m", "messages": list(messages)})
            answer = [rng.randrange(tokens.FIRST_GENERATED, tokens.FIRST_PROMPT) for _ in range(args.answer_tokens)]
            messages.append({"role": "assistant", "content": tokens.decode(answer).lstrip()})
        out.append(bodies)
    return out


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


def cpu_of(prompt_ids: Callable[[str, dict[str, Any], str], Any], body: dict[str, Any]) -> tuple[float, Any]:
    start = time.thread_time()
    result = prompt_ids("m", body, "chat")
    return time.thread_time() - start, result


def measure(source: Path, chats: list[list[dict[str, Any]]]) -> dict[str, Any]:
    cached, whole = ready(source, True), ready(source, False)
    first: list[float] = []
    later: list[float] = []
    later_whole: list[float] = []
    length = 0
    try:
        for bodies in chats:
            for turn, body in enumerate(bodies):
                spent, ids = cpu_of(cached.prompt_ids, body)
                spent_whole, ids_whole = cpu_of(whole.prompt_ids, body)
                if ids is None or ids != ids_whole:
                    raise SystemExit(f"{source}: the cached ids differ from tokenizing whole at turn {turn + 1}")
                (first if turn == 0 else later).append(spent)
                if turn:
                    later_whole.append(spent_whole)
                length = max(length, len(ids))
    finally:
        cached.close()
        whole.close()

    def p50(values: list[float]) -> float:
        return round(statistics.median(values) * 1e6, 1)

    return {
        "last_turn_tokens": length,
        "first_turn_us": p50(first),
        "later_turns_cached_us": p50(later),
        "later_turns_whole_us": p50(later_whole),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    chats = conversations(args)
    with tempfile.TemporaryDirectory() as tmp:
        sources = {
            "vllm-sim (WordPiece)": vocab.write(Path(tmp) / "sim"),
            "ChatML byte-level BPE": chatml_bpe(Path(tmp) / "bpe"),
        }
        report = {name: measure(source, chats) for name, source in sources.items()}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.conversations} conversations x {args.turns} turns; CPU per request, p50 (us)")
    print(f"{'tokenizer':24} {'tokens':>7} {'turn 1':>8} {'turns 2+ cached':>16} {'turns 2+ whole':>15}")
    for name, row in report.items():
        print(
            f"{name:24} {row['last_turn_tokens']:>7} {row['first_turn_us']:>8} "
            f"{row['later_turns_cached_us']:>16} {row['later_turns_whole_us']:>15}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
