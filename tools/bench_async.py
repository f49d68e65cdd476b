#!/usr/bin/env python
"""Streaming modes on a long-tail config, as ratios against the synchronous colocated baseline
measured in the same run (issue 13's benchmark).

The long tail: the quickstart model with ``rollout.max_response_length=224`` (PL 32 + SL fill its 256 positions). Its answers
take 2-3 tokens, but at temperature 1 some samples miss the end-of-sequence token and run to
the limit, so response lengths range from 2 to 224 tokens within one batch.

Each mode trains ``--iterations`` iterations from the same start; the bench prints the mean
steady iteration time, samples/s (G x N per iteration), response tokens/s (tokens really generated and trained),
the stage times, and the held-out greedy accuracy before (iteration 0) and after (``spmd-rl
eval`` on the final checkpoint), because a faster run that learns less does not count.

    python tools/bench_async.py --iterations 20 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LONG_TAIL = ["rollout.max_response_length=224"]  # PL 32 + 224 fills the model's 256 positions
MODES = {
    "sync": [],
    "fuse": ["stream.fuse=true"],
}


def run_mode(name: str, overrides: list[str], args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "spmd_rl.cli", "train", args.config, *LONG_TAIL, *overrides, *args.overrides,
               f"trainer.iterations={args.iterations}", f"trainer.eval_interval={args.iterations}", f"trainer.eval_limit={args.eval_limit}",
               f"checkpoint.dir={tmp}/ckpt", "checkpoint.interval=0", f"logging.dir={tmp}/logs", "logging.progress=false",
               "checkpoint.resume=never", f"metadata.job=bench-async-{name}"]
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if res.returncode:
            sys.exit(f"{name}: train failed ({res.returncode}):\n{res.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "logs/metrics.jsonl").read_text().splitlines()]
        ckpt = sorted((Path(tmp) / "ckpt").glob("iter_*"))[-1]
        ev = subprocess.run([sys.executable, "-m", "spmd_rl.cli", "eval", str(ckpt), "--data", args.test_data,
                             "--limit", str(args.eval_limit), "--max-tokens", "8"], cwd=REPO, capture_output=True, text=True)
        if ev.returncode:
            sys.exit(f"{name}: eval failed ({ev.returncode}):\n{ev.stderr[-3000:]}")
        final = json.loads(ev.stdout.strip().splitlines()[-1])["accuracy"]
    steady = rows[1:] or rows
    out = {k: statistics.mean(r[k] for r in steady) for k in steady[0] if k.startswith("time_")}
    out["iteration_s"] = statistics.mean(r["iteration_s"] for r in steady)
    out["samples_per_s"] = statistics.mean(r["samples"] for r in steady) / out["iteration_s"]
    out["tokens_per_s"] = statistics.mean(r["samples"] * r["response_length_mean"] for r in steady) / out["iteration_s"]
    out["response_length_mean"] = statistics.mean(r["response_length_mean"] for r in steady)
    out["response_length_max"] = max(r["response_length_max"] for r in steady)
    out["accuracy_start"], out["accuracy_final"] = rows[0]["eval_accuracy"], final
    return out


def report(name: str, m: dict, base: dict | None) -> None:
    stages = "  ".join(f"{k[5:]} {v:.2f}" for k, v in m.items() if k.startswith("time_"))
    ratio = f"  x{m['samples_per_s'] / base['samples_per_s']:.2f} samples/s, x{m['tokens_per_s'] / base['tokens_per_s']:.2f} tokens/s vs sync" if base else ""
    print(f"{name:6s} iteration {m['iteration_s']:.2f} s  {m['samples_per_s']:.1f} samples/s  {m['tokens_per_s']:.0f} response tokens/s{ratio}\n"
          f"       responses mean {m['response_length_mean']:.1f} max {m['response_length_max']:.0f}  |  {stages}\n"
          f"       held-out accuracy {m['accuracy_start']:.3f} -> {m['accuracy_final']:.3f} "
          f"({100 * (m['accuracy_final'] - m['accuracy_start']):+.1f} points)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every mode")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    ap.add_argument("--test-data", default="assets/tiny-qwen2/test.jsonl")
    ap.add_argument("--eval-limit", type=int, default=200)
    args = ap.parse_args()
    modes = args.modes.split(",")
    for r in range(args.rounds):
        print(f"-- round {r + 1} (long tail: {' '.join(LONG_TAIL)}, {args.iterations} iterations)", flush=True)
        base = None
        for name in modes:
            m = run_mode(name, MODES[name], args)
            report(name, m, base)
            base = base or (m if name == "sync" else None)


if __name__ == "__main__":
    main()
