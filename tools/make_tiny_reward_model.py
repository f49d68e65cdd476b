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
from pathlib import Path

import torch
from make_tiny_model import prompt_ids  # tools/ is the script's folder
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


def build(model_dir: Path, out: Path, seed: int = 0, steps: int = 600, batch_size: int = 32, lr: float = 5e-4) -> dict:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = policy.config
    cfg.num_labels, cfg.architectures = 1, ["Qwen2ForSequenceClassification"]
    model = Qwen2ForSequenceClassification(cfg)
    model.model.load_state_dict(policy.model.state_dict())
    rows = [json.loads(line) for line in (model_dir / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (model_dir / "test.jsonl").read_text().splitlines()][:200]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    t0 = time.time()
    model.train()
    for step in range(1, steps + 1):
        ids, mask, y = batch(tok, rng.sample(rows, batch_size), rng)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(last_token_logits(model, ids, mask), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0:
            print(f"[make_tiny_reward_model] step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    with torch.no_grad():
        ids, mask, y = batch(tok, test, random.Random(seed + 1))
        acc = float(((last_token_logits(model, ids, mask) > 0).float() == y).float().mean())
    out.mkdir(parents=True, exist_ok=True)
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    report = {"seed": seed, "steps": steps, "held_out_accuracy": acc, "final_loss": float(loss.detach())}
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"[make_tiny_reward_model] wrote {out}: held-out right/wrong accuracy {acc:.3f}", flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", type=Path, required=True, help="The tiny policy folder (tools/make_tiny_model.py --out)."
    )
    ap.add_argument("--out", type=Path, default=None, help="Output folder; default <model>/reward_model.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=600)
    args = ap.parse_args()
    build(args.model, args.out or args.model / "reward_model", args.seed, args.steps)


if __name__ == "__main__":
    main()
