#!/usr/bin/env python
"""The agent gateway's overhead: the calculator's conversation as an in-process environment
(``rollout.environment: calculator``) against the same conversation as an agent calling the
gateway over HTTP (``spmd_rl.gateway.examples.calc_tags_agent``), on one in-process vLLM engine.

Same model, prompts, seeds and temperature, so both paths sample the same tokens (the script
counts the trajectories whose tokens differ). Rounds alternate between the paths; prints the
median seconds per rollout, sampled tokens per second of each, the gateway's ratio to the
in-process path (issue 69's goal: at least 0.9) and the time it adds per call. The tiny tool model
(``assets/tiny-tools``) generates a call in about a millisecond, so it measures the HTTP hop
itself; the benchmark model (``assets/bench-qwen2``, random: every call runs to its limit) is a
call whose generation costs something.

    python tools/bench_gateway.py --prompts 128 --repeats 5
    python tools/bench_gateway.py --model assets/bench-qwen2 --max-tokens 256 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from transformers import AutoTokenizer

from spmd_rl.config.schema import RolloutConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.vllm.engine import VllmRollout
from spmd_rl.engines.vllm.logs import quiet_vllm
from spmd_rl.envs.calculator import Calculator
from spmd_rl.envs.multi_turn import MultiTurnRollout, TurnLimits
from spmd_rl.gateway.rollout import AgentRollout, AgentSettings, end_ids
from spmd_rl.gateway.server import Limits

PROMPT_LEN = 48


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="assets/tiny-tools")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=128)
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
        max_model_len=PROMPT_LEN + args.max_tokens,
        seed=0,
        distributed=False,
    )
    limits = Limits("tiny-tools", PROMPT_LEN + args.max_tokens, args.max_tokens, 1 << 20, 64, "none")
    settings = AgentSettings("spmd_rl.gateway.examples.calc_tags_agent:run", "127.0.0.1", 0, args.concurrency, 600)
    paths = {
        "in-process": MultiTurnRollout(engine, tok, Calculator, TurnLimits(2, args.max_tokens, 30.0), tool_workers=64),
        "gateway": AgentRollout(engine, tok, settings, limits, end_ids(tok)),
    }
    for path in paths.values():
        path.run(items[:8], seed=0)  # warm-up
    times: dict[str, list[float]] = {p: [] for p in paths}
    tokens: dict[str, list[int]] = {p: [] for p in paths}
    differ, calls = 0, 0
    for r in range(args.repeats):
        got = {}
        for name, path in paths.items():
            t0 = time.perf_counter()
            got[name] = path.run(items, seed=r + 1)
            times[name].append(time.perf_counter() - t0)
            tokens[name].append(sum(t.stats["sampled_tokens"] for t in got[name]))
        differ += sum(a.ids != b.ids for a, b in zip(got["in-process"], got["gateway"]))
        calls = sum(t.stats["turns"] for t in got["gateway"])
    paths["gateway"].close()
    print(
        f"{platform.processor() or platform.machine()}, {args.model}: {args.prompts} trajectories of the calculator's "
        f"conversation ({calls} calls), at most {args.max_tokens} response tokens, median of {args.repeats} rounds, "
        f"paths alternating; trajectories whose tokens differ: {differ}"
    )
    print(f"{'path':12s} {'s/rollout':>10s} {'sampled tok/s':>14s} {'vs in-process':>14s} {'added ms/call':>14s}")
    base_s = statistics.median(times["in-process"])
    base = statistics.median(tokens["in-process"]) / base_s
    for name in paths:
        med = statistics.median(times[name])
        rate = statistics.median(tokens[name]) / med
        added = 1000 * (med - base_s) / max(calls, 1)
        print(f"{name:12s} {med:10.3f} {rate:14.1f} {rate / base:13.3f}x {added:14.2f}")


if __name__ == "__main__":
    main()
