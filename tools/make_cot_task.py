#!/usr/bin/env python
"""The chain-of-thought-shaped CPU task: the tiny model's "a+b=" sums asked with a system and a
user message in verl's parquet layout, answered as ``a+b=<s> #### <s>`` (a one-line scratchpad,
then GSM8K's answer marker), scored by ``exact_match`` with ``reward.extract: gsm8k``.

The model is the tiny model taught the format by ``--steps`` supervised steps on the first
``--sft-rows`` training prompts (the true sums written in the format; the tiny model's own,
mostly wrong sums were tried first, and its accuracy under the new system message fell from a
quarter to 4 %: wrong targets do not generalise). GRPO then has most sums left to learn. Written
to ``--out``: the model folder, ``train.parquet`` and ``test.parquet`` (``prompt`` = messages,
``reward_model.ground_truth``, ``data_source``, ``extra_info.index``), and ``warmstart.json``
(steps, the format's share and the accuracy of greedy answers on the test prompts).

    python tools/make_cot_task.py --model assets/tiny-qwen2 --out /tmp/tiny-cot
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SYSTEM = "Add."
SOURCE = "arith_cot"


def messages(prompt: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def verl_rows(rows: list[dict], split: str) -> list[dict]:
    """verl's layout of the tiny task's rows of ``split``."""
    return [
        {
            "data_source": SOURCE,
            "prompt": messages(r["prompt"]),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": r["answer"]},
            "extra_info": {"index": k, "split": split},
        }
        for k, r in enumerate(rows)
    ]


@torch.no_grad()
def greedy(model, tok, conversations: list[list[dict]], max_new_tokens: int) -> list[str]:
    texts = []
    for k in range(0, len(conversations), 256):
        enc = tok.apply_chat_template(
            conversations[k : k + 256], add_generation_prompt=True, return_tensors="pt", padding=True,
            return_dict=True,
        )  # fmt: skip
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        texts += tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return texts


def response(row: dict) -> str:
    """The answer in the task's format: a one-line scratchpad, then ``#### <sum>``."""
    return f"{row['prompt']}{row['answer']} #### {row['answer']}"


def sft(model, tok, rows: list[dict], steps: int, seed: int) -> None:
    """AdamW steps on the response tokens (and <|im_end|>) only."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model.train()
    encoded = [
        (
            tok.apply_chat_template(messages(r["prompt"]), add_generation_prompt=True, return_dict=False),
            tok.encode(response(r), add_special_tokens=False) + [tok.eos_token_id],
        )
        for r in rows
    ]
    for _ in range(steps):
        seqs = [(p + a, [-100] * len(p) + a) for p, a in (encoded[i] for i in rng.sample(range(len(rows)), 32))]
        width = max(len(s) for s, _ in seqs)
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s, _ in seqs])
        lab = torch.tensor([lb + [-100] * (width - len(lb)) for _, lb in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s, _ in seqs])
        model(input_ids=ids, attention_mask=mask, labels=lab).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/tiny-qwen2", help="The tiny model folder (with train/test.jsonl).")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sft-rows", type=int, default=2000, help="Training prompts whose own answers teach the format.")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    src, out = Path(args.model), Path(args.out)
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(src, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    train = [json.loads(x) for x in (src / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (src / "test.jsonl").read_text().splitlines()]
    t0 = time.time()
    rows = train[: args.sft_rows]
    sft(model, tok, rows, args.steps, args.seed)
    got = greedy(model, tok, [messages(r["prompt"]) for r in test], 24)
    formatted = [g for g in got if " #### " in g]
    right = sum(g.rsplit("#### ", 1)[-1].strip() == r["answer"] for g, r in zip(got, test))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.padding_side = "left"
    tok.save_pretrained(out)
    for name, part in (("train", train), ("test", test)):
        pq.write_table(pa.Table.from_pylist(verl_rows(part, name)), out / f"{name}.parquet")
    report = {"steps": args.steps, "format_share": len(formatted) / len(test), "test_accuracy": right / len(test)}
    (out / "warmstart.json").write_text(json.dumps(report | {"seconds": round(time.time() - t0, 1)}) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
