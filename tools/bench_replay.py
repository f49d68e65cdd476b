#!/usr/bin/env python
"""Rollout routing replay (``actor.moe.router_replay``) on the MoE quickstart, measured in one run:
the same config trained with each replay mode (``none``, ``record``, ``rollout`` by default),
rounds alternating. Printed per mode: the held-out greedy accuracy every ``--eval-interval``
iterations (the learning curve), the rollout / trainer log-prob mismatch (mean over
iterations), router agreement and differing tokens (where recorded), the mean steady iteration
and update times (first iteration left out), and each mode's median iteration time over the
rounds divided by ``none``'s.

    python tools/bench_replay.py configs/quickstart_moe.yaml model.dtype=bfloat16 --iterations 61   # evaluates at 0,
    20, 40, 60
    python tools/bench_replay.py configs/quickstart_moe.yaml actor.backend=megatron parallel.train.ep=2 --iterations 10
    --eval-interval 0 --rounds 3
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


def run(args, mode: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "spmd_rl.cli",
            "train",
            args.config,
            *args.overrides,
            f"actor.moe.router_replay={mode}",
            f"trainer.iterations={args.iterations}",
            f"checkpoint.dir={tmp}/ckpt",
            "checkpoint.interval=0",
            "checkpoint.resume=never",
            f"logging.dir={tmp}/logs",
            "logging.progress=false",
            f"eval.interval={args.eval_interval or args.iterations + 1}",
        ]
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if res.returncode:
            sys.exit(f"{mode}: train failed ({res.returncode}):\n{res.stderr[-3000:]}")
        return [json.loads(line) for line in (Path(tmp) / "logs/metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict:
    steady = rows[1:] or rows
    mean = lambda k: statistics.mean(r[k] for r in steady if k in r) if any(k in r for r in steady) else float("nan")
    return {
        "curve": [(r["iteration"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r],
        "mismatch": mean("logprob_mismatch_mean"),
        "agreement": mean("router_agreement"),
        "differ": mean("routes_differ_tokens"),
        "iteration_s": mean("iteration_s"),
        "update_s": mean("time_actor_update"),
        "rollout_s": mean("time_actor_rollout"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--eval-interval", type=int, default=20, help="0: no evaluation (timing only)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--modes", default="none,record,rollout")
    args = ap.parse_args()
    modes = args.modes.split(",")
    got: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            got[mode].append(summary(run(args, mode)))
    print(
        f"{args.config} {' '.join(args.overrides)}: {args.iterations} iterations, {args.rounds} round(s); means over "
        f"iterations 1.., "
        "medians over rounds"
    )
    base = statistics.median(s["iteration_s"] for s in got[modes[0]])
    for mode in modes:
        last = got[mode][-1]
        it = statistics.median(s["iteration_s"] for s in got[mode])
        curve = "  ".join(f"{i}:{a:.3f}" for i, a in last["curve"])
        print(
            f"  {mode:8s} eval accuracy [{curve}]  mismatch {last['mismatch']:.3g}  agreement {last['agreement']:.4f}  "
            f"differing tokens {last['differ']:.4f}  iteration {it:.3f} s ({it / base:.3f}x {modes[0]})  "
            f"update {statistics.median(s['update_s'] for s in got[mode]):.3f} s  rollout "
            f"{statistics.median(s['rollout_s'] for s in got[mode]):.3f} s"
        )


if __name__ == "__main__":
    main()
