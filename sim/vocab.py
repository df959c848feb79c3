"""The simulated model's tokenizer as a Hugging Face tokenizer directory (``vllm-sim --tokenizer DIR``).

The default word tokenizer (``tokens``) hashes any word into an id, which no ``tokenizer.json`` can express. With
``--tokenizer`` the node instead encodes text with a generated WordPiece ``tokenizer.json`` that a router loads
with the ``tokenizers`` library, so both sides see the same ids:
- ids 0-15 are the special tokens of ``tokens.SPECIALS`` (matched anywhere in the text, as added tokens are);
- ids 16-4095 are the generated words ``tok16`` ... ``tok4095``, so generated text re-tokenizes to its ids and
  exact continuation keeps working;
- then a list of common English words (``WORDS``), one id each;
- then every printable ASCII character, alone and as a ``##`` continuation: a word outside the vocabulary is
  spelled with them (a word with another character becomes ``<|unk|>``).
Text is split on whitespace first, as by the word tokenizer. No special token is added around a prompt.

``tokenizer_config.json`` carries ``CHAT_TEMPLATE``, a Jinja2 template that renders ``tokens.render_chat``'s
prompt as text (``<|role|> content <|end|>``); ``continue_final_message`` is transformers' cut after the last
message's content, as vLLM applies it.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from vllm_etcd_proxy.sim import tokens

UNK = "<|unk|>"
WORDS = tuple(
    sorted(
        set(
            "the a an and or but if then else of to in on at by for with from as is are was were be been being it "
            "its this that these those there here what which who whom whose when where why how all any each every "
            "some no not only more most less few many much so very can could will would shall should may might "
            "must do does did done have has had having i you he she we they me him her us them my your our their "
            "one two three four five six seven eight nine ten first last next new old good bad same other own "
            "such just also again still even now up down out over under into through after before while about "
            "between against during without within along across proxy routes each request node serves model "
            "streams tokens back come sessions keep history every turn repeats said before little added cache "
            "prefix latency budget replica balance queue window context summary question answer detail example "
            "session user assistant system tool message text prompt time value please thanks yes hello world data "
            "code test file name list number word line part way day year people thing".split()
        )
    )
)
"""Whole words with an id of their own; the simulator's benchmarks draw their text from these."""
_CHARS = tuple(c for c in string.printable if not c.isspace())
_ROLES = ("system", "user", "assistant", "tool", "developer")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] in " + repr(list(_ROLES)) + " %}{{ '<|' + message['role'] + '|>' }}"
    "{% else %}{{ '<|role|> ' + message['role'] }}{% endif %}"
    "{{ ' ' }}{% if message['content'] is string %}{{ message['content'] }}{% endif %}{{ ' <|end|> ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""Renders as ``tokens.render_chat`` encodes (vLLM hands a template that reads ``content`` as a string the text
parts of a message joined with newlines, as the simulator reads them)."""


def vocabulary() -> dict[str, int]:
    """Every token of the WordPiece vocabulary and its id."""
    vocab = {text: i for i, text in enumerate(tokens.SPECIALS)}
    vocab.update((tokens.word(i), i) for i in range(tokens.FIRST_GENERATED, tokens.FIRST_PROMPT))
    pieces = [w for w in WORDS if w not in vocab] + [*_CHARS, *(f"##{c}" for c in _CHARS), UNK]
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    return vocab


def build() -> Tokenizer:
    """The tokenizer of the module docstring."""
    model = models.WordPiece(vocabulary(), unk_token=UNK, max_input_chars_per_word=1000)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*tokens.SPECIALS, UNK)])
    return tokenizer


def write(directory: str | Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) into ``directory``. Each
    file is written aside and renamed into place, so that nodes started at once on the same directory (and a
    router reading it) never see half a file; the config goes first, since ``tokenizer.json`` is what says the
    directory is written."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|eos|>",
        "unk_token": UNK,
        "bos_token": None,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }
    aside = path / f"tokenizer_config.json.{os.getpid()}"
    aside.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(aside, path / "tokenizer_config.json")
    aside = path / f"tokenizer.json.{os.getpid()}"
    build().save(str(aside))
    os.replace(aside, path / "tokenizer.json")
    return path


class HfVocab:
    """Text -> ids with a ``tokenizer.json`` directory (written first when it has none)."""

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        if not (path / "tokenizer.json").is_file():
            write(path)
        self.directory = path
        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)
