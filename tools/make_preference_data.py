#!/usr/bin/env python
"""Build the tiny preference set for DPO from the quickstart task: each "a+b=" prompt of
``<model>/train.jsonl`` and ``test.jsonl`` with the sum as the chosen response and a near miss
as the rejected one (the sum off by 1, 2, 10 or 11 either way, never negative): the mistakes the
warm-started tiny model makes. Seeded, so every machine builds the same pairs.

    python tools/make_preference_data.py --model assets/tiny-qwen2
    # -> assets/tiny-qwen2/preferences_train.jsonl, preferences_test.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OFFSETS = (-11, -10, -2, -1, 1, 2, 10, 11)


def pairs(rows: list[dict], seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for row in rows:
        right = int(row["answer"])
        wrong = right + rng.choice([d for d in OFFSETS if right + d >= 0])
        out.append({"prompt": row["prompt"], "chosen": str(right), "rejected": str(wrong)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the tiny model folder holding train.jsonl and test.jsonl")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    folder = Path(args.model)
    for k, split in enumerate(("train", "test")):
        rows = [json.loads(line) for line in (folder / f"{split}.jsonl").read_text().splitlines() if line.strip()]
        out = folder / f"preferences_{split}.jsonl"
        out.write_text("".join(json.dumps(p) + "\n" for p in pairs(rows, args.seed + k)))
        print(f"wrote {out} ({len(rows)} pairs)")


if __name__ == "__main__":
    main()
