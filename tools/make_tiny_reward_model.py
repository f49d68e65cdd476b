#!/usr/bin/env python
"""Build the tiny reward model for ``reward.kind: model``: a one-label sequence classifier
(Qwen2ForSequenceClassification) on the tiny policy's trunk and tokenizer, trained briefly to
tell correct answers of the synthetic "a+b=" task from wrong ones.

Input: the chat-templated prompt followed by a response, exactly the token ids the dock holds
(prompt_ids ++ response_ids, with or without the closing <|im_end|>). Positives are the right
sum; negatives are near misses (off by 1-10), random numbers and random byte strings.
About a minute on 2 CPU cores; held-out accuracy about 0.83 (seed 0). The
score is the head's logit at the last token, so a positive logit means "probably correct".
Deterministic for a given seed; prints the held-out pair accuracy and writes it to
``reward_model/train_report.json``.

    python tools/make_tiny_reward_model.py --model assets/tiny-qwen2   # writes assets/tiny-qwen2/reward_model
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from make_tiny_model import load_weights, prompt_ids, weights_origin  # tools/ is the script's folder
from transformers import AutoTokenizer, Qwen2ForCausalLM, Qwen2ForSequenceClassification


def _response(tok, rng: random.Random, answer: str, correct: bool) -> list[int]:
    if correct:
        text = answer
    else:
        kind = rng.random()
        if kind < 0.3:
            text = str(max(0, int(answer) + rng.choice([-1, 1]) * rng.randint(1, 10)))
        elif kind < 0.8:
            text = str(rng.randint(0, 198))
        else:
            text = "".join(rng.choice("0123456789+= abc") for _ in range(rng.randint(1, 6)))
    ids = tok.encode(text, add_special_tokens=False)
    return ids + [tok.eos_token_id]


def batch(tok, rows: list[dict], rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and 0/1 labels: each row once right, once wrong."""
    seqs, labels = [], []
    for r in rows:
        p = prompt_ids(tok, r["prompt"])
        for correct in (True, False):
            seqs.append(p + _response(tok, rng, r["answer"], correct))
            labels.append(float(correct))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask, torch.tensor(labels)


def last_token_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The head at each row's last real token (what the reward stage scores)."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    last = mask.sum(1) - 1
    return model.score(hidden[torch.arange(len(ids)), last]).squeeze(-1)


def initial_model(model_dir: Path, seed: int):
    """(tokenizer, the classifier before training): the policy's trunk and a seeded score head."""
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = policy.config
    cfg.num_labels, cfg.architectures = 1, ["Qwen2ForSequenceClassification"]
    model = Qwen2ForSequenceClassification(cfg)
    model.model.load_state_dict(policy.model.state_dict())
    return tok, model


def reward_steps(model, tok, rows: list[dict], seed: int, batch_size: int, lr: float) -> Iterator[float]:
    """The training steps, endless, yielding each step's loss: binary cross-entropy of the last
    token's logit on ``batch_size`` prompts drawn with ``random.Random(seed)``, each once right and
    once wrong; AdamW, gradients clipped to norm 1. Seeded: ``tools/tiny_weights.py`` checks the
    committed weights' first losses against these."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    while True:
        ids, mask, y = batch(tok, rng.sample(rows, batch_size), rng)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(last_token_logits(model, ids, mask), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss.item()


def build(
    model_dir: Path,
    out: Path,
    seed: int = 0,
    steps: int = 600,
    batch_size: int = 32,
    lr: float = 5e-4,
    weights: Path | None = None,
) -> dict:
    """Train (or, with ``weights``, load) the classifier, measure it on 200 held-out prompts and
    write the folder; ``train_report.json`` last."""
    tok, model = initial_model(model_dir, seed)
    rows = [json.loads(line) for line in (model_dir / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (model_dir / "test.jsonl").read_text().splitlines()][:200]
    if weights:
        model, recorded = load_weights(model, weights)
        steps, final_loss = recorded["steps"], recorded["final_loss"]
    else:
        t0 = time.time()
        for step, final_loss in zip(range(1, steps + 1), reward_steps(model, tok, rows, seed, batch_size, lr)):
            if step % 100 == 0:
                print(
                    f"[make_tiny_reward_model] step {step} loss {final_loss:.4f} ({time.time() - t0:.0f}s)", flush=True
                )
    model.eval()
    with torch.no_grad():
        ids, mask, y = batch(tok, test, random.Random(seed + 1))
        acc = float(((last_token_logits(model, ids, mask) > 0).float() == y).float().mean())
    out.mkdir(parents=True, exist_ok=True)
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    report = {"seed": seed, "steps": steps, "held_out_accuracy": acc, "final_loss": final_loss} | weights_origin(
        weights
    )
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"[make_tiny_reward_model] wrote {out}: held-out right/wrong accuracy {acc:.3f}", flush=True)
    return report


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", type=Path, required=True, help="The tiny policy folder (tools/make_tiny_model.py --out)."
    )
    ap.add_argument("--out", type=Path, default=None, help="Output folder; default <model>/reward_model.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument(
        "--weights",
        type=Path,
        help="Take the trained weights from this file (tools/tiny_weights/) instead of training.",
    )
    return ap


def main() -> None:
    args = parser().parse_args()
    build(
        args.model,
        args.out or args.model / "reward_model",
        args.seed,
        args.steps,
        args.batch_size,
        args.lr,
        args.weights,
    )


if __name__ == "__main__":
    main()
