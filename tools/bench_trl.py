#!/usr/bin/env python
"""TRL's ``GRPOTrainer`` on the same model, prompts and batch as an spmd-rl config: the peer
baseline of issue 12. TRL is not a project dependency; run this with a Python that has it:

    python3 -m venv /work/trl-venv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /work/trl-venv/lib/python3.11/site-packages/project.pth
    /work/trl-venv/bin/pip install trl
    /work/trl-venv/bin/python tools/bench_trl.py configs/bench_cpu.yaml --steps 6

Matched to the config: G prompts x N generations per optimizer step (one step per
generation), beta = 0, the same lr, temperature, SL and max grad norm, the same master dtype
and compute dtype (``bf16=True`` autocast when ``model.dtype`` is bfloat16), one process owning
every core. TRL's default generation (transformers ``generate``); responses are forced to SL tokens
(``min_new_tokens``), which spmd-rl's random model reaches about 93 % of the time anyway, and
the throughput counts the tokens really generated. The reward is 0, as in spmd-rl's benchmark.
Prints one JSON line: the median step time after the first and tokens/s (prompt + response).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    try:
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        sys.exit(f"bench_trl needs TRL ({e}); see this script's docstring for a separate venv")
    from spmd_rl.config.loader import load_config

    torch.set_num_threads(os.cpu_count())
    cfg = load_config(args.config, args.overrides)
    g, n, sl = cfg.data.global_batch_size, cfg.rollout.n, cfg.rollout.max_response_length
    rows = [json.loads(line) for line in Path(cfg.data.train_path).read_text().splitlines()[: g * (args.steps + 1)]]
    data = Dataset.from_list([{"prompt": r[cfg.data.prompt_column]} for r in rows])
    tok = AutoTokenizer.from_pretrained(cfg.model.path, padding_side="left")
    # master weights in actor.param_dtype; model.dtype bfloat16 = TRL's bf16 autocast, as spmd-rl's mixed precision
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.actor.param_dtype))
    stamps: list[float] = []
    tokens: list[int] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            stamps.append(time.perf_counter())

    micro = cfg.actor.micro_batch_size * cfg.parallel.train.dp_shard
    with tempfile.TemporaryDirectory() as tmp:
        conf = GRPOConfig(
            output_dir=tmp, learning_rate=cfg.actor.lr, lr_scheduler_type="constant", beta=0.0, num_generations=n,
            per_device_train_batch_size=micro, gradient_accumulation_steps=g * n // micro, max_completion_length=sl,
            temperature=cfg.rollout.temperature, max_grad_norm=cfg.actor.grad_clip, max_steps=args.steps + 1,
            generation_kwargs={"min_new_tokens": sl}, logging_steps=1, save_strategy="no", report_to=[],
            use_cpu=True, bf16=cfg.model.dtype == "bfloat16", seed=cfg.trainer.seed, shuffle_dataset=False,
        )

        def zero_reward(completions, completion_ids=None, **_k):
            tokens.append(sum(len(c) for c in completion_ids) if completion_ids is not None else g * n * sl)
            return [0.0] * len(completions)

        trainer = GRPOTrainer(model=model, reward_funcs=zero_reward, args=conf, train_dataset=data,
                              processing_class=tok, callbacks=[Clock()])
        t0 = time.perf_counter()
        trainer.train()
    times = [b - a for a, b in zip([t0, *stamps], stamps)][1:]
    step = statistics.median(times)
    per_step = g * n * cfg.data.max_prompt_length + statistics.median(tokens[1:] or tokens)
    print(json.dumps({"trl_step_s": step, "trl_tokens_per_s": per_step / step, "trl_steps": len(times),
                      "trl_step_times": [round(t, 3) for t in times]}))


if __name__ == "__main__":
    main()
