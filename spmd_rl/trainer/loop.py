"""The SPMD iteration (paper Figure 1), identical on every rank:

prompts -> reshard (allgather-swap) -> generate -> reshard back -> reward -> [ref log-prob] ->
[old log-prob] -> advantage -> update -> commit -> [checkpoint]

Each stage talks to the others only through the dock, so generation DP and training DP may
differ. Reference and old-log-prob passes run only when the config needs them
(config.stages).
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from spmd_rl.config.stages import needs_old_log_prob, needs_reference
from spmd_rl.trainer import checkpoint, stages
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.metrics import MetricsLog, StageTimer, global_max, global_sums, throughput

log = logging.getLogger("spmd_rl")


def run_iteration(run: Run, it: int) -> dict[str, float]:
    cfg = run.cfg
    G, N = cfg.data.global_batch_size, cfg.rollout.n
    timer = StageTimer()
    t0 = time.perf_counter()
    positions = run.sampler.next_batch(G)
    answers = {p: run.prompts.answers[pos] for p, pos in enumerate(positions)}
    run.dock.begin_iteration(it, G * N)
    with timer.stage("prompts"):
        stages.put_prompts(run, it, positions)
    with timer.stage("reshard"):
        run.rollout.restore_kv_cache()
        run.resharder.to_generation()
    with timer.stage("generate"):
        stages.rollout(run, it)
    with timer.stage("reshard_back"):
        run.rollout.release_kv_cache()
        run.resharder.to_training()
    with timer.stage("reward"):
        sums = stages.reward(run, it, answers)
    use_ref, use_old = needs_reference(cfg), needs_old_log_prob(cfg)
    micro = cfg.ref.micro_batch_size or cfg.actor.micro_batch_size
    if use_ref:
        with timer.stage("ref_logprob"):
            run.ref_swap.reload()
            stages.logprob_stage(run, it, "ref_logprob", run.ref, "ref_log_prob", micro)
            if cfg.ref.offload_to_host:
                run.ref_swap.offload()
    if use_old:
        with timer.stage("actor_logprob"):
            stages.logprob_stage(run, it, "actor_logprob", run.actor, "old_log_prob", cfg.actor.micro_batch_size)
    with timer.stage("advantage"):
        sums |= stages.advantage(run, it)
    with timer.stage("update"):
        upd = stages.update(run, it, use_ref, use_old)
    dist.barrier()
    run.dock.commit(it)
    ete = time.perf_counter() - t0
    response_max = global_max(sums.pop("response_max"))
    g = global_sums(sums)
    n = max(1.0, g["samples"])
    mean = g["reward_sum"] / n
    out = {
        "reward_mean": mean, "reward_std": max(0.0, g["reward_sq"] / n - mean**2) ** 0.5, "accuracy": g["correct"] / n,
        "response_length_mean": g["response_tokens"] / n, "response_length_max": response_max,
        "world": run.lay.world, "samples": g["samples"], "dropped_samples": g["dropped_samples"], **upd, "iteration_s": ete,
        "throughput_eq5": throughput(G, N, cfg.data.max_prompt_length, cfg.rollout.max_response_length, run.lay.world, ete),
        **{f"time_{k}": v for k, v in timer.times.items()},
    }
    return out


def train(run: Run, start_iteration: int) -> None:
    cfg = run.cfg
    rank0 = run.peer.rank == 0
    metrics = MetricsLog(cfg.logging.dir, cfg.logging.jsonl, cfg.logging.tensorboard, enabled=rank0)
    console = None
    if rank0 and cfg.logging.progress:
        from rich.console import Console

        console = Console(stderr=True)
    for it in range(start_iteration, cfg.trainer.iterations):
        m = run_iteration(run, it)
        metrics.write(it, m)
        if console is not None:
            console.print(
                f"[bold]iter {it + 1}/{cfg.trainer.iterations}[/] reward {m['reward_mean']:.3f} acc {m['accuracy']:.3f} "
                f"len {m['response_length_mean']:.1f} loss {m['loss']:+.4f} gnorm {m['grad_norm']:.3f} "
                f"clip {m['clip_frac']:.3f} ent {m['entropy']:.3f} | {m['iteration_s']:.2f}s "
                f"T {m['throughput_eq5']:.0f} tok/s/dev"
            )
        last = it + 1 == cfg.trainer.iterations
        if (cfg.checkpoint.interval and (it + 1) % cfg.checkpoint.interval == 0) or last:
            state = {"iteration": it + 1, "sampler": {"epoch": run.sampler.state.epoch, "offset": run.sampler.state.offset},
                     "rng": checkpoint.rng_state(), "model_path": cfg.model.path, "tokenizer_path": cfg.model.tokenizer_path or cfg.model.path}
            folder = checkpoint.save(cfg.checkpoint.dir, it + 1, run.actor, state, cfg.checkpoint.keep)
            if rank0:
                log.info("saved checkpoint %s", folder)
    metrics.close()
