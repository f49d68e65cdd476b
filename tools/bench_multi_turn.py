#!/usr/bin/env python
"""Generation throughput of multi-turn rollouts: continuous batching across trajectories vs
lock-step turns, in one run on one in-process vLLM engine.

The tool example (``assets/tiny-tools``, the ``calculator`` environment, temperature 1): each
repeat runs the same trajectories (same per-turn seeds, so the same tokens) once per mode, the
modes alternating. ``--tool-latency-ms`` adds a seeded exponential delay of that mean to every
tool call, as a real tool (a sandboxed interpreter, a search API) has; 0 is the calculator as it
is. Prints the median seconds per rollout and sampled tokens per second of each mode and their
ratio.

    python tools/bench_multi_turn.py --model assets/tiny-tools --prompts 128 --repeats 5 --tool-latency-ms 50
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from transformers import AutoTokenizer

from spmd_rl.config.schema import RolloutConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.vllm.engine import VllmRollout
from spmd_rl.engines.vllm.logs import quiet_vllm
from spmd_rl.envs.calculator import Calculator
from spmd_rl.envs.multi_turn import MultiTurnRollout, TurnLimits


def slow_calculator(mean_s: float):
    """The calculator with a delay per call drawn from Exp(mean), seeded by the prompt."""

    class Slow(Calculator):
        def __init__(self, row):
            super().__init__(row)
            self.rng = random.Random(row["prompt"])

        def step(self, turn):
            if mean_s:
                time.sleep(self.rng.expovariate(1.0 / mean_s))
            return super().step(turn)

    return Slow


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="assets/tiny-tools")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--tool-latency-ms", type=float, default=50.0)
    args = ap.parse_args()
    quiet_vllm(None, 0)
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(line) for line in open(f"{args.model}/train.jsonl")][: args.prompts]
    items = [
        (
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=False
            ),
            r,
        )
        for r in rows
    ]
    engine = VllmRollout.build(
        args.model,
        detect("cpu"),
        RolloutConfig(n=1, max_response_length=args.max_tokens),
        tp=1,
        dtype="float32",
        max_model_len=256,
        seed=0,
        distributed=False,
    )
    limits = TurnLimits(args.max_turns, args.max_tokens, 30.0)
    env = slow_calculator(args.tool_latency_ms / 1000)
    modes = {
        "continuous": MultiTurnRollout(engine, tok, env, limits, tool_workers=64),
        "lock-step": MultiTurnRollout(engine, tok, env, limits, lockstep=True, tool_workers=64),
    }
    modes["continuous"].run(items[:8], seed=0)  # warm-up
    times: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, int] = {}
    for r in range(args.repeats):
        for name, rollout in modes.items():
            t0 = time.perf_counter()
            trajs = rollout.run(items, seed=r)
            times[name].append(time.perf_counter() - t0)
            tokens[name] = sum(t.stats["sampled_tokens"] for t in trajs)
            calls = sum(t.stats["tool_calls"] for t in trajs)
    print(
        f"{args.prompts} trajectories, at most {args.max_turns} turns, tool latency Exp(mean {args.tool_latency_ms:g} "
        f"ms), "
        f"{calls} tool calls in the last repeat; median of {args.repeats} repeats, modes alternating"
    )
    print(f"{'mode':12s} {'s/rollout':>10s} {'sampled tok/s':>14s} {'vs lock-step':>13s}")
    base = statistics.median(times["lock-step"])
    for name in modes:
        med = statistics.median(times[name])
        print(f"{name:12s} {med:10.3f} {tokens[name] / med:14.1f} {base / med:12.2f}x")


if __name__ == "__main__":
    main()
