#!/usr/bin/env python
"""Build the tiny local model, tokenizer and synthetic task every test and the quickstart use.

Deterministic for a given seed and torch build. Writes a standard HF folder (Qwen2
architecture, safetensors, fast tokenizer with pad/eos and a chat template) loadable by
``transformers`` and by vLLM, plus ``train.jsonl`` / ``test.jsonl`` with ``prompt`` and
``answer`` columns for the task "a+b=" with 0 <= a, b < 100. The tiny reward model is built
from it by ``tools/make_tiny_reward_model.py --model <out>`` (into ``<out>/reward_model``), which
imports this module (not the other way round). ``--arch qwen3_moe`` builds the
MoE sibling instead (Qwen3-MoE: the same width, depth and tokenizer, head_dim 32 as vLLM's CPU
attention needs, 4 experts of which 2 are routed per token, each half the dense MLP's width, so
a token computes what a dense token does; trained with the load-balancing loss; no reward model).

The model is warm-started by a short supervised run that stops as soon as greedy accuracy on
the test prompts reaches ``--target-accuracy`` (so the RL run has room to improve it); the
final accuracy is printed and stored in ``warmstart.json``.

    python tools/make_tiny_model.py --out assets/tiny-qwen2
    python tools/make_tiny_model.py --arch qwen3_moe --out assets/tiny-qwen3-moe
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MAX_OPERAND = 100


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges, as Qwen2's tokenizer class expects: every byte is one
    token (so any text round-trips), plus the three chat special tokens."""
    specials = [PAD, IM_START, IM_END]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, chat_template=CHAT_TEMPLATE, padding_side="left"
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=272,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(cfg)


def build_moe_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=272,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=192,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        router_aux_loss_coef=0.01,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    return Qwen3MoeForCausalLM(cfg)


def make_task(seed: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """All pairs (a, b) split into disjoint train and test sets."""
    pairs = [(a, b) for a in range(MAX_OPERAND) for b in range(MAX_OPERAND)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    return rows[n_test:], rows[:n_test]


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The chat-templated prompt's ids, a fresh list each call (the cached one is shared)."""
    return list(_prompt_ids(tokenizer, prompt))


@functools.cache
def _prompt_ids(tokenizer, prompt: str) -> tuple[int, ...]:
    """Rendering the jinja chat template is about 0.2 ms a prompt, and the warm starts render
    each prompt many times (64 a step, 200 an evaluation): cached, a build renders each once."""
    return tuple(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def pad(tokenizer, seqs: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, attention mask, labels) of (ids, labels) sequences; labels -100 past each."""
    width = max(len(i) for i, _ in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    lab = torch.full((len(seqs), width), -100)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for k, (i, l) in enumerate(seqs):
        ids[k, : len(i)], lab[k, : len(l)], mask[k, : len(i)] = torch.tensor(i), torch.tensor(l), 1
    return ids, mask, lab


def sft_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, attention mask, labels); the loss covers the answer and <|im_end|> only."""
    seqs = []
    for r in rows:
        p = prompt_ids(tokenizer, r["prompt"])
        a = tokenizer.encode(r["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
        seqs.append((p + a, [-100] * len(p) + a))
    return pad(tokenizer, seqs)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int = 6) -> float:
    model.eval()
    enc = tokenizer.pad(
        {"input_ids": [prompt_ids(tokenizer, r["prompt"]) for r in rows]}, padding=True, return_tensors="pt"
    )
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train()
    return sum(t.strip() == r["answer"] for t, r in zip(texts, rows)) / len(rows)


def sft_steps(model, tokenizer, train: list[dict], args) -> Iterator[float]:
    """The warm start's supervised steps, endless, yielding each step's loss: ``--batch-size``
    prompts drawn with ``random.Random(--seed)``, AdamW at ``--lr``, gradients clipped to norm 1
    (the MoE sibling adds its load-balancing loss). Seeded, so every run takes the same steps:
    ``tools/tiny_weights.py`` checks the committed weights' first losses against these."""
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    moe = {"output_router_logits": True} if getattr(model.config, "num_experts", 0) else {}
    while True:
        ids, mask, lab = sft_batch(tokenizer, rng.sample(train, args.batch_size))
        loss = model(input_ids=ids, attention_mask=mask, labels=lab, **moe).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss.item()


def warm_start(model, tokenizer, train, test, args) -> tuple[int, float]:
    """``sft_steps`` until greedy accuracy on the first ``--eval-prompts`` test prompts, measured
    every ``--eval-every`` steps, reaches ``--target-accuracy`` (or ``--max-steps``)."""
    probe = test[: args.eval_prompts]
    acc, step = 0.0, 0
    t0 = time.time()
    for step, loss in zip(range(1, args.max_steps + 1), sft_steps(model, tokenizer, train, args)):
        if step % args.eval_every == 0:
            acc = greedy_accuracy(model, tokenizer, probe)
            print(
                f"[make_tiny_model {args.arch}] step {step:5d} loss {loss:.4f} test acc {acc:.3f} "
                f"({time.time() - t0:.0f}s)",
                flush=True,
            )
            if acc >= args.target_accuracy:
                break
    return step, acc


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="Output folder (model + tokenizer + data).")
    ap.add_argument(
        "--arch", choices=("qwen2", "qwen3_moe"), default="qwen2", help="Dense Qwen2, or its Qwen3-MoE sibling."
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-test", type=int, default=500, help="Held-out prompts.")
    ap.add_argument(
        "--target-accuracy", type=float, default=0.25, help="Stop the warm start at this greedy test accuracy."
    )
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-prompts", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--weights",
        type=Path,
        help="Take the warm-started weights from this file (tools/tiny_weights/, written by tools/tiny_weights.py "
        "pack) instead of training them; everything else is built as without it.",
    )
    return ap


def load_weights(model, path: Path):
    """``(model, report)``: a model of ``model``'s class and config holding the committed weights
    (stored in float16, ``tools/tiny_weights.py``) in the config's dtype, loaded through
    transformers (which maps a checkpoint's per-expert tensors onto the fused MoE layers), every
    tensor accounted for; and the report the builder wrote when it trained them. Torch's random
    state is left as it was, so what the builder samples next is what it sampled after training."""
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, "pt") as f:
        state = {k: f.get_tensor(k).to(torch.float32) for k in f.keys()}
        report = json.loads((f.metadata() or {}).get("report", "{}"))
    rng = torch.get_rng_state()
    with tempfile.TemporaryDirectory() as folder:
        model.config.save_pretrained(folder)
        save_file(state, f"{folder}/model.safetensors", metadata={"format": "pt"})
        loaded, info = type(model).from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    torch.set_rng_state(rng)
    if not report or any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        raise SystemExit(
            f"{path} does not hold this builder's model ({ {k: list(v)[:3] for k, v in info.items() if v} }, "
            f"report {report}): run tools/tiny_weights.py rebuild"
        )
    loaded.train(model.training)
    return loaded, report


def weights_origin(path: Path | None) -> dict:
    """The report's record of committed weights: their file's sha256 (``tools/tiny_weights.py``
    builds again a folder whose record differs from the file it has now)."""
    return {"weights_sha256": hashlib.sha256(path.read_bytes()).hexdigest()} if path else {}


def main() -> None:
    args = parser().parse_args()

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = build_tokenizer()
    model = (build_moe_model if args.arch == "qwen3_moe" else build_model)(tokenizer, args.seed)
    train, test = make_task(args.seed, args.n_test)
    print(
        f"[make_tiny_model {args.arch}] {sum(p.numel() for p in model.parameters()) / 1e6:.3f} M parameters, "
        f"{len(train)} train / {len(test)} test prompts",
        flush=True,
    )
    if args.weights:
        model, recorded = load_weights(model, args.weights)
        steps = recorded["sft_steps"]
    else:
        steps, _ = warm_start(model, tokenizer, train, test, args) if args.max_steps else (0, 0.0)
    full_acc = greedy_accuracy(model, tokenizer, test)
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    for name, rows in (("train", train), ("test", test)):
        with open(args.out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    report = {"seed": args.seed, "sft_steps": steps, "test_accuracy": full_acc, "n_test": len(test)}
    report |= weights_origin(args.weights)
    (args.out / "warmstart.json").write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"[make_tiny_model {args.arch}] wrote {args.out}: greedy accuracy on all {len(test)} test prompts = "
        f"{full_acc:.3f} after {steps} SFT steps",
        flush=True,
    )


if __name__ == "__main__":
    main()
