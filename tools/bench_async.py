#!/usr/bin/env python
"""The benchmark of the streaming modes (stage fusion, partial rollout, the asynchronous
separated placement) against the synchronous colocated baseline, as ratios measured in the
same run, with the learning each mode still does.

**Speed** on a long tail: ``configs/bench_cpu.yaml`` (G=16, N=8, 2 ranks) on the long-tail
bench model (``make_bench_model.py --stop-tokens 15``: response lengths close to geometric,
mean about 60) with ``rollout.max_response_length=256``. Printed per mode: the mean steady
iteration time, samples/s and response tokens/s (what was really generated and trained, from
the metrics), the stage times, and the ratios to ``sync``.

**Learning** (``--learn-iterations K``): the quickstart trained K iterations in each mode;
held-out greedy accuracy before (iteration 0) and after (``spmd-rl eval`` of the final
checkpoint), because a faster run that learns less does not count.

    python tools/make_bench_model.py --out assets/bench-longtail --positions 512 --stop-tokens 15
    python tools/bench_async.py --iterations 8 --rounds 2 --learn-iterations 200
    python tools/bench_async.py --modes sync,partial model.dtype=bfloat16   # overrides: every run
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
LONG_TAIL = [
    "model.path=assets/bench-longtail",
    "data.train_path=assets/bench-longtail/train.jsonl",
    "rollout.max_response_length=256",
]
SEPARATED = [
    "parallel.placement=separated",
    "parallel.gen_ranks=1",
    "parallel.gen.dp=1",
    "parallel.train.dp_shard=1",
    "actor.correction.tis_cap=2.0",
]
"""AsyncFlow's separated placement with k = 1: rank 0 generates, rank 1 trains."""
MODES = {  # mode: (speed overrides, quickstart overrides)
    "sync": ([], []),
    "fuse": (["stream.fuse=true"], ["stream.fuse=true"]),
    "partial": (
        ["stream.partial_tokens={budget}", "actor.correction.tis_cap=2.0"],
        ["stream.partial_tokens=4", "actor.correction.tis_cap=2.0"],
    ),
    "async": (SEPARATED, SEPARATED),
}


def train(
    config: str, overrides: list[str], iterations: int, name: str, tmp: str, eval_limit: int | None = None
) -> list[dict]:
    extra = [f"eval.interval={iterations}", f"eval.limit={eval_limit}"] if eval_limit else []
    cmd = [
        sys.executable,
        "-m",
        "spmd_rl.cli",
        "train",
        config,
        *overrides,
        *extra,
        f"trainer.iterations={iterations}",
        f"checkpoint.dir={tmp}/ckpt",
        "checkpoint.interval=0",
        f"logging.dir={tmp}/logs",
        "logging.progress=false",
        "checkpoint.resume=never",
        f"metadata.job=bench-async-{name}",
    ]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"{name}: train failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in (Path(tmp) / "logs/metrics.jsonl").read_text().splitlines()]


def speed(name: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        rows = train(
            args.config,
            LONG_TAIL + args.overrides + [o.format(budget=args.partial_tokens) for o in MODES[name][0]],
            args.iterations,
            name,
            tmp,
        )
    steady = rows[1:] or rows
    seconds = sum(r["iteration_s"] for r in steady)
    out = {k: statistics.mean(r.get(k, 0.0) for r in steady) for k in steady[0] if k.startswith("time_")}
    out["iteration_s"] = seconds / len(steady)
    out["samples_per_s"] = sum(r["samples"] for r in steady) / seconds
    out["tokens_per_s"] = sum(r["samples"] * r.get("response_length_mean", 0.0) for r in steady) / seconds
    out["response_length_mean"] = statistics.mean(r.get("response_length_mean", 0.0) for r in steady if r["samples"])
    out["response_length_max"] = max(r.get("response_length_max", 0.0) for r in steady)
    out["micro_batches"] = statistics.mean(r.get("micro_batches", 0.0) for r in steady)  # per optimizer step and rank
    return out


def learning(name: str, args, seed: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        rows = train(
            "configs/quickstart.yaml",
            args.overrides + MODES[name][1] + [f"trainer.seed={seed}"],
            args.learn_iterations,
            f"learn-{name}",
            tmp,
            args.eval_limit,
        )
        ckpt = sorted((Path(tmp) / "ckpt").glob("iter_*"))[-1]
        ev = subprocess.run(
            [
                sys.executable,
                "-m",
                "spmd_rl.cli",
                "eval",
                str(ckpt),
                "--data",
                "assets/tiny-qwen2/test.jsonl",
                "--limit",
                str(args.eval_limit),
                "--max-tokens",
                "8",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if ev.returncode:
            sys.exit(f"{name}: eval failed ({ev.returncode}):\n{ev.stderr[-3000:]}")
    return rows[0]["eval_accuracy"], json.loads(ev.stdout.strip().splitlines()[-1])["accuracy"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/bench_cpu.yaml")
    ap.add_argument(
        "overrides", nargs="*", help="key=value overrides for every run, speed and learning (e.g. model.dtype=bfloat16)"
    )
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)} (sync is the baseline)"
    )
    ap.add_argument(
        "--learn-iterations",
        type=int,
        default=0,
        help="quickstart iterations per mode for the learning check; 0 skips it",
    )
    ap.add_argument("--eval-limit", type=int, default=500)
    ap.add_argument(
        "--seeds",
        default="0",
        help="comma-separated trainer.seed values of the learning runs (RL on the tiny task is noisy)",
    )
    ap.add_argument(
        "--partial-tokens", type=int, default=128, help="stream.partial_tokens of the partial mode's speed run"
    )
    args = ap.parse_args()
    modes = ["sync"] + [m for m in args.modes.split(",") if m != "sync"]
    for r in range(args.rounds):
        print(
            f"-- speed, round {r + 1}: {' '.join(LONG_TAIL + args.overrides)}, {args.iterations} iterations", flush=True
        )
        base = None
        for name in modes:
            m = speed(name, args)
            base = base or m
            stages = "  ".join(f"{k[5:]} {v:.2f}" for k, v in m.items() if k.startswith("time_"))
            print(
                f"{name:8s} {m['iteration_s']:.2f} s/iteration  {m['samples_per_s']:.1f} samples/s  "
                f"{m['tokens_per_s']:.0f} tokens/s  "
                f"x{m['samples_per_s'] / base['samples_per_s']:.2f} samples/s  "
                f"x{m['tokens_per_s'] / base['tokens_per_s']:.2f} tokens/s vs sync\n"
                f"         responses mean {m['response_length_mean']:.1f} max {m['response_length_max']:.0f}  "
                f"micro-batches {m['micro_batches']:.1f}  |  {stages}",
                flush=True,
            )
    if args.learn_iterations:
        print(
            f"-- learning: quickstart, {args.learn_iterations} iterations, held-out greedy accuracy on "
            f"{args.eval_limit} prompts",
            flush=True,
        )
        for seed in (int(x) for x in args.seeds.split(",")):
            for name in modes:
                start, final = learning(name, args, seed)
                print(
                    f"{name:8s} seed {seed}  {start:.3f} -> {final:.3f}  ({100 * (final - start):+.1f} points)  "
                    f"{' '.join(MODES[name][1])}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
