#!/usr/bin/env python
"""What per-request seeds cost the sampler: the same batch generated with every request seeded
(the sample's index, as the rollout stage seeds it so a re-dealt prompt samples the same tokens)
and unseeded, on one in-process vLLM engine, rounds alternating (issue 70, finding 7).

vLLM's GPU sampler takes a per-request generator path for seeded requests; this measures the
CPU engine's. Prints the median seconds and sampled tokens per second of each and the ratio.

    python tools/bench_seeded.py --prompts 256 --n 4 --repeats 5
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="assets/tiny-qwen2")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    quiet_vllm(None, 0)
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(line) for line in open(f"{args.model}/train.jsonl")][: args.prompts]
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for r in rows
    ]
    engine = VllmRollout.build(
        args.model,
        detect("cpu"),
        RolloutConfig(n=args.n, max_response_length=args.max_tokens),
        tp=1,
        dtype="float32",
        max_model_len=256,
        seed=0,
        distributed=False,
    )
    engine.generate(prompts[:8], args.n, args.max_tokens, seed=1)  # warm-up
    times: dict[str, list[float]] = {"seeded": [], "unseeded": []}
    tokens: dict[str, list[int]] = {"seeded": [], "unseeded": []}
    for r in range(args.repeats):
        for mode in times:
            t0 = time.perf_counter()
            got = engine.generate(prompts, args.n, args.max_tokens, seed=r + 1 if mode == "seeded" else None)
            times[mode].append(time.perf_counter() - t0)
            tokens[mode].append(sum(len(s.token_ids) for s in got))
    print(
        f"{platform.processor() or platform.machine()}, {args.model}: {args.prompts} prompts x {args.n} samples, "
        f"at most {args.max_tokens} tokens, median of {args.repeats} rounds, modes alternating"
    )
    print(f"{'mode':10s} {'s/batch':>9s} {'sampled tok/s':>14s} {'vs unseeded':>12s}")
    base = statistics.median(tokens["unseeded"]) / statistics.median(times["unseeded"])
    for mode in ("unseeded", "seeded"):
        rate = statistics.median(tokens[mode]) / statistics.median(times[mode])
        print(f"{mode:10s} {statistics.median(times[mode]):9.3f} {rate:14.1f} {rate / base:11.3f}x")


if __name__ == "__main__":
    main()
