#!/usr/bin/env python
"""The engines' floor for one iteration of a config: what the two engines cost alone,
in one process that owns every core, with none of spmd-rl around them.

- generation: vLLM ``LLM.generate`` of the iteration's G prompts x N samples (same sampling,
  same SL, same dtype), after one warm-up call;
- training: one optimizer step of plain HF ``AutoModelForCausalLM`` on those samples (right
  padded, longest first as the trainer orders them; the response log-probs of
  ``engines.training.logprobs``, a token-mean policy-gradient loss, backward in micro-batches of
  ``actor.micro_batch_size x train DP`` samples, and at most
  ``actor.micro_batch_tokens x train DP`` tokens when that is set; AdamW), after one warm-up
  step. Master weights in ``actor.param_dtype``; compute under autocast when ``model.dtype``
  differs, as the FSDP engine's mixed precision does; decoder layers compiled when
  ``actor.compile``; each micro-batch packed padding-free when ``actor.pack_sequences``
  (``engines.fsdp.packing``, as the engine does) (vLLM's own compilation follows
  ``rollout.vllm.enforce_eager``).

floor = generation + training. Prints one JSON line (seconds, medians over ``--repeats``).

``--flat`` also times generating the same number of response tokens with no long tail (every
sample exactly the mean response length, EOS ignored) and prints the **streaming bound**
(generation + training) / (flat generation + training): the most any streaming mode (stage
fusion, partial rollout, asynchronous) can gain by hiding the tail, when, as on a few cores, no
core sits idle while the tail is generated.

    python tools/engine_floor.py configs/bench_cpu.yaml
    python tools/engine_floor.py configs/bench_cpu.yaml model.path=assets/bench-longtail rollout.max_response_length=256
    --flat
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spmd_rl.config.loader import load_config  # noqa: E402
from spmd_rl.data.prompts import load_tokenizer, prompts_for  # noqa: E402
from spmd_rl.engines.base import DTYPES  # noqa: E402
from spmd_rl.engines.fsdp.parallelize import apply_compile  # noqa: E402
from spmd_rl.engines.training.logprobs import build_batch, lm_response_logprobs  # noqa: E402
from spmd_rl.engines.fsdp.packing import packed_response_logprobs  # noqa: E402
from spmd_rl.engines.training.token_logprob import SamplingPolicy  # noqa: E402
from spmd_rl.trainer.stages.micro import token_runs  # noqa: E402


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def generation(cfg, prompts: list[list[int]], repeats: int, flat: bool = False) -> dict:
    """``floor_generation_s`` and the ``responses``; with ``flat``, ``flat_generation_s`` and the
    distinct response lengths of that run (one: the mean)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(cfg.rollout.kv_cache_gib))))
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=cfg.model.path,
        dtype=cfg.model.dtype,
        max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_response_length,
        seed=cfg.trainer.seed,
        enforce_eager=cfg.rollout.vllm.enforce_eager,
        enable_prefix_caching=False,
    )
    outs: list = []

    def timed(length: int, **fixed) -> float:
        """Median seconds of generating every prompt's N samples of at most ``length`` tokens."""
        params = SamplingParams(
            n=cfg.rollout.n,
            max_tokens=length,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            logprobs=0,
            **fixed,
        )

        def run():
            outs[:] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

        return _median_time(run, repeats)

    got = {
        "floor_generation_s": timed(cfg.rollout.max_response_length),
        "responses": [list(c.token_ids) for o in outs for c in o.outputs],
    }
    if flat:  # the same tokens, no tail
        mean = max(1, round(sum(map(len, got["responses"])) / len(got["responses"])))
        got["flat_generation_s"] = timed(mean, min_tokens=mean, ignore_eos=True)
        got["flat_response_lengths"] = sorted({len(c.token_ids) for o in outs for c in o.outputs})
    return got


def training(cfg, prompts: list[list[int]], responses: list[list[int]], pad_id: int, repeats: int, model=None) -> float:
    """Median seconds of one training step of the batch; ``model``: the HF model to train (loaded
    from ``cfg.model.path`` when None), so a caller can see what the steps did to it."""
    from transformers import AutoModelForCausalLM

    master, compute = DTYPES[cfg.actor.param_dtype], DTYPES[cfg.model.dtype]
    model = model if model is not None else AutoModelForCausalLM.from_pretrained(cfg.model.path, torch_dtype=master)
    model.config.use_cache = False
    if cfg.actor.compile:
        apply_compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.actor.optim.lr, foreach=False)
    ps = [torch.tensor(p) for p in prompts for _ in range(cfg.rollout.n)]
    batch = build_batch(ps, [torch.tensor(r) for r in responses], pad_id)
    adv = torch.randn(len(batch), 1).expand(-1, batch.mask.shape[1])
    tokens = batch.mask.sum()
    dp = cfg.parallel.train.dp_shard  # this one process does the work of the DP ranks
    budget = cfg.actor.micro_batch_tokens and cfg.actor.micro_batch_tokens * dp
    order = torch.argsort(batch.attention_mask.sum(1), descending=True, stable=True)  # as the trainer orders
    batch, adv = batch[order], adv[order]
    runs = token_runs(
        batch.attention_mask.sum(1).tolist(), cfg.actor.micro_batch_size * dp, budget, cfg.actor.pack_sequences
    )
    cast = torch.autocast("cpu", dtype=compute) if compute != master else contextlib.nullcontext()
    logprobs = packed_response_logprobs if cfg.actor.pack_sequences else lm_response_logprobs
    policy = SamplingPolicy.of(cfg.rollout)

    def step():
        model.train()
        for r in runs:
            m = batch[r].trim()
            with cast:
                lp, _ = logprobs(model, m, False, policy)
            (-(lp * adv[r, : lp.shape[1]] * m.mask).sum() / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.actor.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _median_time(step, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument(
        "--flat",
        action="store_true",
        help="Also time the same response tokens with no tail; print the streaming bound.",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    tok = load_tokenizer(cfg)
    ps = prompts_for(cfg, tok, cfg.data.train_path)
    prompts = [list(ps.prompt_ids[i]) for i in range(cfg.data.global_batch_size)]
    out = generation(cfg, prompts, args.repeats, args.flat)
    responses = out.pop("responses")
    t_gen, t_train = out["floor_generation_s"], training(cfg, prompts, responses, tok.pad_token_id, args.repeats)
    out |= {
        "floor_training_s": t_train,
        "floor_s": t_gen + t_train,
        "response_tokens": sum(map(len, responses)),
        "samples": len(responses),
    }
    if args.flat:
        out["streaming_bound"] = (t_gen + t_train) / (out["flat_generation_s"] + t_train)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
