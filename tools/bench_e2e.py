#!/usr/bin/env python
"""End-to-end benchmark: run ``spmd-rl train`` on a config for a few iterations and print the
mean time of every stage, the iteration time and the paper's throughput T (Eq. 5,
tokens / s / device), leaving out the first (warm-up) iteration.

    python tools/bench_e2e.py configs/quickstart.yaml --iterations 12
    python tools/bench_e2e.py configs/quickstart.yaml --iterations 12 dock.mode=centralized
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--iterations", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "spmd_rl.cli", "train", args.config, *args.overrides,
               f"trainer.iterations={args.iterations}", f"checkpoint.dir={tmp}/ckpt", "checkpoint.interval=0",
               f"logging.dir={tmp}/logs", "logging.progress=false", "checkpoint.resume=never"]
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if res.returncode:
            sys.exit(f"train failed ({res.returncode}):\n{res.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "logs/metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows
    stages = [k for k in steady[0] if k.startswith("time_")]
    total = statistics.mean(r["iteration_s"] for r in steady)
    print(f"{args.config} {' '.join(args.overrides)}: {len(steady)} iterations after warm-up")
    for k in stages:
        t = statistics.mean(r[k] for r in steady)
        print(f"  {k[5:]:14s} {t:8.3f} s  {100 * t / total:5.1f} %")
    print(f"  {'iteration':14s} {total:8.3f} s  (first iteration {rows[0]['iteration_s']:.3f} s)")
    print(f"  T (Eq. 5)      {statistics.mean(r['throughput_eq5'] for r in steady):8.1f} tokens/s/device")
    print(f"  accuracy       {rows[0]['accuracy']:.3f} -> {rows[-1]['accuracy']:.3f} (sampled, training prompts)")


if __name__ == "__main__":
    main()
