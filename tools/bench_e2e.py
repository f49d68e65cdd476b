#!/usr/bin/env python
"""End-to-end benchmark: run ``spmd-rl train`` on a config for a few iterations and print the
mean time of every stage, the iteration time, the tokens/s and the paper's throughput T
(Eq. 5, tokens / s / device), leaving out the first (warm-up) iteration, and how long the
fastest generation rank waited for the slowest (the bound on what balancing the generation work
across ranks could save). In the same run:

- the engines' floor (``tools/engine_floor.py``: vLLM generation alone + one plain training
  step of the same batch, one process owning every core), and the ratio iteration / floor;
- with ``--trl-python``, TRL's GRPOTrainer on the same model and batch (``tools/bench_trl.py``,
  run by a Python that has TRL) on the same number of ranks, in its vLLM colocate mode (what
  TRL users run) and its transformers ``generate`` mode (``--trl-modes``), and the ratio of
  tokens/s spmd-rl / TRL per mode. The summary gives each ratio's median over the rounds.

tokens/s counts what was really trained: each iteration's samples x (PL + their mean response length),
over the summed iteration time (partial rollout trains fewer samples in some iterations).
``--rounds K`` repeats the measurements alternately (these machines are noisy). ``--versus
"k=v ..."`` runs the config a second time per round with more overrides (another backend or
layout) and prints the ratio of tokens/s, first / second.

    python tools/bench_e2e.py configs/bench_cpu.yaml --iterations 8
    python tools/bench_e2e.py configs/bench_cpu.yaml model.dtype=bfloat16 --trl-python /work/trl-venv/bin/python
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


def _json_tail(cmd: list[str], what: str) -> dict:
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"{what} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def spmd_rl(args, pl: int, extra: list[str] = ()) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "spmd_rl.cli",
            "train",
            args.config,
            *args.overrides,
            *extra,
            f"trainer.iterations={args.iterations}",
            f"checkpoint.dir={tmp}/ckpt",
            "checkpoint.interval=0",
            f"logging.dir={tmp}/logs",
            "logging.progress=false",
            "checkpoint.resume=never",
        ]
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if res.returncode:
            sys.exit(f"train failed ({res.returncode}):\n{res.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "logs/metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows
    out = {k: statistics.mean(r.get(k, 0.0) for r in steady) for k in steady[0] if k.startswith("time_")}
    # what was really trained per second: each iteration's own sample count (partial rollout trains
    # fewer groups in some iterations) x (prompt + its mean response), over the summed iteration time
    out["tokens_per_s"] = sum(r["samples"] * (pl + r["response_length_mean"]) for r in steady) / sum(
        r["iteration_s"] for r in steady
    )
    out["iteration_s"] = statistics.mean(r["iteration_s"] for r in steady)
    out["first_iteration_s"] = rows[0]["iteration_s"]
    out["eq5"] = statistics.mean(r["throughput_eq5"] for r in steady)
    out["response_length_mean"] = statistics.mean(r["response_length_mean"] for r in steady)
    out["mismatch"] = statistics.mean(r["logprob_mismatch_mean"] for r in steady)
    out["generation_wait_s"] = statistics.mean(r["generation_s_max"] - r["generation_s_min"] for r in steady)
    out["iterations"] = len(steady)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-floor", dest="floor", action="store_false")
    ap.add_argument(
        "--versus",
        help="more overrides, space-separated: every round also runs the config with them (e.g. "
        "'actor.backend=megatron parallel.train.tp=2 parallel.train.dp_shard=1') and prints tokens/s first / second",
    )
    ap.add_argument("--trl-python", help="A Python with TRL installed (tools/bench_trl.py); omit to skip TRL.")
    ap.add_argument("--trl-modes", default="vllm,generate", help="TRL's generation modes to run, in order")
    ap.add_argument(
        "--trl-forced-lengths",
        action="store_true",
        help="force TRL's responses to SL tokens (bench_trl.py --forced-lengths); by default they end on the model's "
        "stop tokens, as spmd-rl's do",
    )
    args = ap.parse_args()
    ratios: dict[str, list[float]] = {}
    sys.path.insert(0, str(REPO))
    from spmd_rl.config.loader import load_config

    cfg = load_config(args.config, args.overrides)
    pl = cfg.data.max_prompt_length
    print(f"{args.config} {' '.join(args.overrides)}")
    for rnd in range(args.rounds):
        run = spmd_rl(args, pl)
        tps = run["tokens_per_s"]
        print(f"round {rnd}: spmd-rl, {run['iterations']} iterations after warm-up")
        for k in (k for k in run if k.startswith("time_")):
            print(f"  {k[5:]:14s} {run[k]:8.3f} s  {100 * run[k] / run['iteration_s']:5.1f} %")
        print(f"  {'iteration':14s} {run['iteration_s']:8.3f} s  (first iteration {run['first_iteration_s']:.3f} s)")
        print(
            f"  tokens/s       {tps:8.0f}  (mean response {run['response_length_mean']:.1f} tokens; "
            f"T Eq. 5 {run['eq5']:.0f} tokens/s/device; rollout/train log-prob mismatch {run['mismatch']:.2e})"
        )
        print(
            f"  generation     slowest - fastest rank {run['generation_wait_s']:.3f} s "
            f"({100 * run['generation_wait_s'] / run['iteration_s']:.1f} % of the iteration: the most a better "
            f"balance of the generation work could save)"
        )
        if args.versus:
            other = spmd_rl(args, pl, args.versus.split())
            ratios.setdefault("versus", []).append(tps / other["tokens_per_s"])
            stages = "  ".join(f"{k[5:]} {other[k]:.3f} s" for k in other if k.startswith("time_"))
            print(
                f"  with {args.versus}: iteration {other['iteration_s']:.3f} s ({stages}), {other['tokens_per_s']:.0f} "
                f"tokens/s, "
                f"mismatch {other['mismatch']:.2e}; first / second = {ratios['versus'][-1]:.3f}x"
            )
        if args.floor:
            fl = _json_tail([sys.executable, "tools/engine_floor.py", args.config, *args.overrides], "engine_floor")
            print(
                f"  floor          {fl['floor_s']:8.3f} s  (generation {fl['floor_generation_s']:.3f} s + training "
                f"step "
                f"{fl['floor_training_s']:.3f} s)  iteration / floor = {run['iteration_s'] / fl['floor_s']:.3f}"
            )
        for mode in args.trl_modes.split(",") if args.trl_python else []:
            trl = _json_tail(
                [
                    args.trl_python,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    str(cfg.parallel.nproc_per_node),
                    "tools/bench_trl.py",
                    args.config,
                    *args.overrides,
                    "--steps",
                    str(args.iterations),
                    "--mode",
                    mode,
                    *(["--forced-lengths"] if args.trl_forced_lengths else []),
                ],
                f"bench_trl --mode {mode}",
            )
            ratios.setdefault(mode, []).append(tps / trl["trl_tokens_per_s"])
            print(
                f"  TRL {mode:10s} {trl['trl_step_s']:8.3f} s per step, {trl['trl_tokens_per_s']:.0f} tokens/s  "
                f"spmd-rl / TRL = {ratios[mode][-1]:.3f}x"
            )
    for mode, r in ratios.items():
        if mode == "versus":
            print(
                f"without / with {args.versus}: median {statistics.median(r):.3f}x over {len(r)} round(s) "
                f"({', '.join(f'{x:.3f}' for x in r)})"
            )
            continue
        print(
            f"spmd-rl / TRL {mode}: median {statistics.median(r):.3f}x over {len(r)} round(s) "
            f"({', '.join(f'{x:.3f}' for x in r)})"
        )


if __name__ == "__main__":
    main()
