"""Tiny dense models of the architectures practitioners bring besides Qwen2, made locally with
random weights and the tiny model's byte-level tokenizer and chat template:

- ``qwen3``: Qwen3 dense (q/k norms, no qkv bias, explicit head_dim), GQA 4:2, tied head;
- ``llama3``: Llama 3.1 (``rope_type: llama3`` scaling), GQA 4:1, untied head, and a tokenizer
  saved without a pad token, as Llama 3's ships.

Random weights answer nothing right; a run on them shows the architecture goes through every
stage (vLLM generation, the trainer's log-probs against vLLM's, the update, the weight sync).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

REPO = Path(__file__).resolve().parents[1]
COMMON = dict(
    vocab_size=272,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=None,
    dtype="float32",
)


def make(arch: str, out: Path) -> Path:
    """The tiny ``arch`` model folder at ``out``; its tokenizer is the tiny model's."""
    tok = AutoTokenizer.from_pretrained(REPO / "assets/tiny-qwen2")
    torch.manual_seed(0)
    if arch == "qwen3":
        cfg = Qwen3Config(
            **COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )  # fmt: skip
        model = Qwen3ForCausalLM(cfg)
    elif arch == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
        cfg = LlamaConfig(
            **COMMON, num_key_value_heads=1, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
            rope_parameters=rope,
        )  # fmt: skip
        model = LlamaForCausalLM(cfg)
        tok.pad_token = None  # Llama 3's tokenizer has none
    else:
        raise ValueError(arch)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
