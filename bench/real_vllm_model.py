"""Run by the real vLLM's own interpreter (bench/real_vllm_env.py): a tiny random Llama and a LoRA adapter for it.

    python bench/real_vllm_model.py MODEL_DIR LORA_DIR

MODEL_DIR already holds the tokenizer (tokenizer.json, tokenizer_config.json); the vocabulary is sized to it.
head_dim is 32: vLLM's CPU attention backend refuses 16. The adapter (rank 8 on q_proj and v_proj, PEFT's file
layout) is random too: its answers differ from the base model's, which is all a check needs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

HIDDEN, HEADS, LAYERS, INTERMEDIATE = 64, 2, 2, 128
LORA_RANK = 8
LORA_TARGETS = ("q_proj", "v_proj")


def vocab_size(model_dir: Path) -> int:
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    ids = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer.get("added_tokens", [])}
    return int(max(ids)) + 1


def make_model(model_dir: Path) -> None:
    config = LlamaConfig(
        vocab_size=vocab_size(model_dir),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=16384,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(model_dir), safe_serialization=True)


def make_lora(model_dir: Path, lora_dir: Path) -> None:
    lora_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for layer in range(LAYERS):
        for target in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, HIDDEN, generator=generator) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(HIDDEN, LORA_RANK, generator=generator) * 0.1
    save_file(tensors, str(lora_dir / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (lora_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str]) -> int:
    model_dir, lora_dir = Path(argv[1]), Path(argv[2])
    make_model(model_dir)
    make_lora(model_dir, lora_dir)
    print(f"model {model_dir} vocab={vocab_size(model_dir)}; adapter {lora_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
