#!/usr/bin/env python
"""Build the paper-shaped benchmark model and prompts for ``tools/bench_e2e.py`` and
``tools/bench_trl.py``: a random (untrained) Qwen2 with hidden 256, 4 layers,
4 heads / 2 KV heads, intermediate 512, vocabulary 1000, tied embeddings (2.6 M parameters),
and prompts of exactly 16 tokens.

The tokenizer is the tiny model's byte-level one (``make_tiny_model.build_tokenizer``) padded
with plain added tokens ``<|vNNN|>`` up to the vocabulary, so every id the random model can
sample decodes. A random model emits <|im_end|> with probability about 1/1000 per token, so
responses run to the length limit almost always: the benchmark measures full-length work.
``--positions`` sets max_position_embeddings (PL + SL must fit: 512 for the long-response case).

``--stop-tokens K`` builds the long-tail variant for ``tools/bench_async.py``: K more added
tokens also end a response (generation_config's eos_token_id list, which vLLM stops on), so a
response stops with probability about (K + 1) / vocab per token. Lengths are then close to
geometric: with K = 15, a mean near 60 tokens and a tail that reaches a 256-token limit.

    python tools/make_bench_model.py --out assets/bench-qwen2 --positions 512
    python tools/make_bench_model.py --out assets/bench-longtail --positions 512 --stop-tokens 15
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from make_tiny_model import build_tokenizer  # tools/ is the script's folder

PROMPT_TOKENS = 16


def build(out: Path, vocab: int, positions: int, prompts: int, seed: int, stop_tokens: int = 0) -> None:
    tok = build_tokenizer()
    tok.add_tokens([f"<|v{i:03d}|>" for i in range(vocab - len(tok))])
    assert len(tok) == vocab, (len(tok), vocab)
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(cfg)
    stops = [tok.eos_token_id] + list(range(vocab - stop_tokens, vocab))
    model.generation_config = GenerationConfig(eos_token_id=stops, pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    rng = random.Random(seed)
    with open(out / "train.jsonl", "w") as f:
        for _ in range(prompts):  # one ASCII letter is one token: exactly PROMPT_TOKENS tokens
            text = "".join(rng.choice(string.ascii_lowercase) for _ in range(PROMPT_TOKENS))
            f.write(json.dumps({"prompt": text, "answer": "0"}) + "\n")
    n = sum(p.numel() for p in model.parameters())
    print(
        f"[make_bench_model] wrote {out}: {n / 1e6:.2f} M parameters, vocab {vocab}, {positions} positions, "
        f"{prompts} prompts of {PROMPT_TOKENS} tokens, {len(stops)} stop token(s)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--positions", type=int, default=512, help="max_position_embeddings (>= PL + SL).")
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--stop-tokens",
        type=int,
        default=0,
        help="Extra added tokens that also end a response (the long-tail variant).",
    )
    args = ap.parse_args()
    build(args.out, args.vocab, args.positions, args.prompts, args.seed, args.stop_tokens)


if __name__ == "__main__":
    main()
