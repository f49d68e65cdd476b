#!/usr/bin/env python
"""A reward that hangs now and then, against the same reward that does not, in one run:
``configs/quickstart.yaml`` trained with ``exact_match`` (baseline) and with ``sleepy``, which
sleeps ``--sleep`` seconds on a ``--share`` of its calls before answering, under
``reward.timeout_s`` (``--timeout``). Rounds alternate the two; per side the median over rounds
of the mean steady iteration time (first iteration left out) and of the reward stage's time,
the timeouts counted (``reward_timeouts``), and the ratio of the sleeper's iteration time to
the baseline's.

    python tools/bench_reward_sleeper.py --iterations 8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLEEP_S = float(os.environ.get("SPMD_RL_SLEEPER_S", "10"))
SHARE = float(os.environ.get("SPMD_RL_SLEEPER_SHARE", "0.01"))


def sleepy(response: str, answer: str, row: dict) -> float:
    """exact_match, after sleeping ``SLEEP_S`` on a ``SHARE`` of the calls."""
    from spmd_rl.rewards import get_reward

    if random.random() < SHARE:
        time.sleep(SLEEP_S)
    return get_reward("exact_match")(response, answer, row)


def run(args, rule: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "spmd_rl.cli", "train", "configs/quickstart.yaml", *args.overrides]
        cmd += [f"reward.rule={rule}", f"reward.timeout_s={args.timeout}", f"trainer.iterations={args.iterations}"]
        cmd += [f"checkpoint.dir={tmp}/ckpt", "checkpoint.interval=0", "checkpoint.resume=never"]
        cmd += [f"logging.dir={tmp}/logs", "logging.progress=false", f"metadata.job=sleeper-{os.getpid()}"]
        env = os.environ | {
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "SPMD_RL_SLEEPER_S": str(args.sleep),
            "SPMD_RL_SLEEPER_SHARE": str(args.share),
        }
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
        if res.returncode:
            sys.exit(f"{rule}: train failed ({res.returncode}):\n{res.stderr[-3000:]}")
        return [json.loads(line) for line in (Path(tmp) / "logs/metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict:
    steady = rows[1:] or rows
    reward_key = next((k for k in steady[0] if k.startswith("time_") and "reward" in k), None)
    return {
        "iteration_s": statistics.mean(r["iteration_s"] for r in steady),
        "reward_s": statistics.mean(r[reward_key] for r in steady) if reward_key else float("nan"),
        "timeouts": sum(r.get("reward_timeouts", 0) for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sleep", type=float, default=10.0)
    ap.add_argument("--share", type=float, default=0.01)
    ap.add_argument("--timeout", type=float, default=0.5)
    args = ap.parse_args()
    sides = {"baseline": "exact_match", "sleeper": "tools.bench_reward_sleeper:sleepy"}
    got: dict[str, list[dict]] = {s: [] for s in sides}
    for _ in range(args.rounds):
        for side, rule in sides.items():
            got[side].append(summary(run(args, rule)))
    med = {s: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for s, rows in got.items()}
    print(
        f"quickstart, {args.iterations} iterations x {args.rounds} rounds; sleeper: {args.sleep:g} s on "
        f"{args.share:.0%} of calls, reward.timeout_s {args.timeout:g}; medians over rounds"
    )
    print(f"{'side':>9} {'iteration s':>12} {'reward s':>9} {'timeouts':>9}")
    for s, m in med.items():
        print(f"{s:>9} {m['iteration_s']:12.3f} {m['reward_s']:9.3f} {m['timeouts']:9.0f}")
    print(f"sleeper / baseline iteration time: {med['sleeper']['iteration_s'] / med['baseline']['iteration_s']:.3f}")


if __name__ == "__main__":
    main()
