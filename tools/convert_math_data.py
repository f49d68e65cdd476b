#!/usr/bin/env python
"""Convert GSM8K's and MATH's published files to the data contract (verl's parquet layout, which
``data.*`` reads as it is: docs/bring-your-run.md):

    {"data_source", "prompt": [{"role": "user", "content"}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth"}, "extra_info": {"split", "index", ...}}

- GSM8K (``openai/gsm8k``: ``question``, ``answer`` ending in ``#### <n>``): the ground truth is
  the number after ``####`` (thousands commas dropped); the prompt asks for that format, so
  ``reward.extract: gsm8k`` scores it.
- MATH (``hendrycks/competition_math`` and its copies: ``problem``, ``solution`` with a final
  ``\\boxed{}``, ``level``, ``type``): the ground truth is the last boxed answer; the prompt asks
  for ``\\boxed{}``; ``level`` and ``type`` go to ``extra_info``.

The input is a .parquet or .jsonl file as the dataset publishes it (no hub is reached); the
output is .parquet or .jsonl by its extension. A row without its fields, or whose answer has no
final ``####`` / ``\\boxed{}``, stops the conversion naming the file and row.

    python tools/convert_math_data.py gsm8k train.parquet data/gsm8k/train.parquet --split train
    python tools/convert_math_data.py math test.jsonl data/math/test.parquet --split test
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spmd_rl.data.prompts import load_rows  # noqa: E402
from spmd_rl.rewards.extract import boxed, gsm8k  # noqa: E402

INSTRUCTIONS = {
    "gsm8k": 'Let\'s think step by step and output the final answer after "####".',
    "math": "Let's think step by step and output the final answer within \\boxed{}.",
}
SOURCES = {"gsm8k": "openai/gsm8k", "math": "hendrycks/competition_math"}
FIELDS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution")}


class BadSourceRow(ValueError):
    pass


def convert_row(kind: str, row: dict, index: int, split: str, where: str) -> dict:
    """One published row in the contract's layout (module docstring)."""
    question_field, answer_field = FIELDS[kind]
    question, worked = row.get(question_field), row.get(answer_field)
    if not isinstance(question, str) or not isinstance(worked, str):
        raise BadSourceRow(f"{where}: needs text fields {question_field!r} and {answer_field!r}")
    final = gsm8k(worked) if kind == "gsm8k" else boxed(worked)
    if final is None:
        mark = "final '#### <number>'" if kind == "gsm8k" else "final \\boxed{}"
        raise BadSourceRow(f"{where}: {answer_field!r} has no {mark}")
    extra = {"split": split, "index": index, answer_field: worked, question_field: question}
    extra |= {k: row[k] for k in ("level", "type") if k in row}
    return {
        "data_source": SOURCES[kind],
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTIONS[kind]}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final.replace(",", "") if kind == "gsm8k" else final},
        "extra_info": extra,
    }


def convert(kind: str, source: Path, out: Path, split: str) -> int:
    rows = [convert_row(kind, r, k, split, f"{source}: row {k}") for k, r in enumerate(load_rows(source))]
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), str(out))
    else:
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=sorted(FIELDS))
    p.add_argument("source", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--split", default="train")
    args = p.parse_args(argv)
    try:
        n = convert(args.kind, args.source, args.out, args.split)
    except (BadSourceRow, ValueError, OSError) as exc:
        print(f"INVALID {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
