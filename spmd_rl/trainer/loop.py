"""The SPMD iteration (paper Figure 1), identical on every rank:

[eval] -> reshard (allgather-swap) -> (prompts -> generate -> reward) x rounds -> reshard back ->
[ref log-prob] -> [old log-prob] -> advantage -> update -> commit -> [checkpoint]

One generation round unless DAPO dynamic sampling, which adds rounds until G prompt groups
carry signal (algos.dynamic_sampling); the later stages read only the selected groups.

Each stage talks to the others only through the dock, so generation DP and training DP may
differ. Reference and old-log-prob passes run only when the config needs them
(config.stages).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch.distributed as dist

from spmd_rl.algos.dynamic_sampling import GroupSelection
from spmd_rl.config.stages import dynamic_sampling, generation_rounds, needs_old_log_prob, needs_reference, ref_micro_batch_size
from spmd_rl.distributed.timeouts import long_phase
from spmd_rl.engines.base import local
from spmd_rl.reshard.swap import resident_bytes
from spmd_rl.trainer import checkpoint, stages
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.progress import progress_for
from spmd_rl.trainer.metrics import MetricsLog, StageTimer, global_max, global_sums, throughput
from spmd_rl.trainer.update import update

log = logging.getLogger("spmd_rl")


def _generate_rounds(run: Run, it: int, timer: StageTimer) -> tuple[list[int], dict[str, float], dict[str, float]]:
    """[Eval,] generation and reward, in rounds of G prompts (one round unless DAPO dynamic
    sampling). Round r's prompt p is group r * G + p, its samples indices (r * G + p) * N + k.
    Returns the sample indices to train on, this rank's metric sums and the metrics every
    rank already agrees on."""
    cfg = run.cfg
    G, N = cfg.data.global_batch_size, cfg.rollout.n
    select = GroupSelection(G) if dynamic_sampling(cfg) else None
    sums: dict[str, float] = {}
    with timer.stage("reshard"):
        run.resharder.to_generation()
    same = {k: global_max(v) for k, v in run.resharder.generation_memory().items()}
    if run.evaluator is not None and it % cfg.trainer.eval_interval == 0:
        with timer.stage("eval"):
            same["eval_accuracy"] = run.evaluator()
    for r in range(generation_rounds(cfg)):
        positions = run.sampler.next_batch(G)
        expected = list(range(r * G * N, (r + 1) * G * N))
        with timer.stage("prompts"):
            stages.put_prompts(run, it, positions, first_group=r * G)
        with timer.stage("generate"):
            stages.rollout(run, it, expected)
        with timer.stage("reward"):
            part, dense = stages.reward(run, it, expected)
        response_max = max(sums.pop("response_max", 0.0), part.pop("response_max"))
        sums = {k: sums.get(k, 0.0) + v for k, v in part.items()} | {"response_max": response_max}
        if select is None:
            break
        dist.all_reduce(dense)
        select.add_round(list(range(r * G, (r + 1) * G)), dense, N)
        if select.done:
            break
    with timer.stage("reshard_back"):
        run.resharder.to_training()
    if select is None:
        return list(range(G * N)), sums, same
    groups, short = select.final()
    if short and run.peer.rank == 0:
        log.warning("dynamic sampling: only %d of %d groups carried signal after %d rounds; topped up with %d constant groups "
                    "(raise algorithm.max_extra_rounds)", G - short, G, select.rounds, short)
    same |= {"dapo_rounds": select.rounds, "dapo_kept_groups": G - short,
             "dapo_discarded_groups": select.rounds * G - G + short, "dapo_filler_groups": short}
    return [q * N + k for q in groups for k in range(N)], sums, same


def run_iteration(run: Run, it: int, on_stage: Callable[[str], None] | None = None) -> dict[str, float]:
    cfg = run.cfg
    G, N = cfg.data.global_batch_size, cfg.rollout.n
    timer = StageTimer(on_stage)
    t0 = time.perf_counter()
    run.dock.begin_iteration(it, generation_rounds(cfg) * G * N)
    train_idx, sums, same = _generate_rounds(run, it, timer)
    use_ref, use_old = needs_reference(cfg), needs_old_log_prob(cfg)
    if use_ref:
        with timer.stage("ref_logprob"):
            run.ref_swap.reload()
            stages.logprob_stage(run, it, "ref_logprob", run.ref, "ref_log_prob", ref_micro_batch_size(cfg), train_idx)
            if cfg.ref.offload_to_host:
                run.ref_swap.offload()
            sums["ref_resident_bytes"] = float(resident_bytes(run.ref.param_tensors()))
    if use_old:
        with timer.stage("actor_logprob"):
            stages.logprob_stage(run, it, "actor_logprob", run.actor, "old_log_prob", cfg.actor.micro_batch_size, train_idx)
    with timer.stage("advantage"):
        sums |= stages.advantage(run, it, train_idx)
    with timer.stage("update"):
        upd = update(run, it, train_idx)
    dist.barrier()
    run.dock.commit(it)
    ete = time.perf_counter() - t0
    response_max = global_max(sums.pop("response_max"))
    g = global_sums(sums)
    n = max(1.0, g.pop("generated"))
    mean = g["reward_sum"] / n
    out = {
        "reward_mean": mean, "reward_std": max(0.0, g["reward_sq"] / n - mean**2) ** 0.5, "accuracy": g["correct"] / n,
        "response_length_mean": g["response_tokens"] / n, "response_length_max": response_max,
        "world": run.lay.world, "samples": len(train_idx), "generated_samples": n, "adv_zero_groups": g["adv_zero_groups"],
        **({"ref_resident_bytes": g["ref_resident_bytes"]} if "ref_resident_bytes" in g else {}),
        **upd, **same, "iteration_s": ete,
        "throughput_eq5": throughput(G, N, cfg.data.max_prompt_length, cfg.rollout.max_response_length, run.lay.world, ete),
        **{f"time_{k}": v for k, v in timer.times.items()},
    }
    return out


def train(run: Run, start_iteration: int) -> None:
    cfg = run.cfg
    rank0 = run.peer.rank == 0
    metrics = MetricsLog(cfg.logging.dir, cfg.logging.jsonl, cfg.logging.tensorboard, enabled=rank0, start_iteration=start_iteration)
    bar = progress_for(rank0 and cfg.logging.progress, cfg.trainer.iterations, start_iteration)
    for it in range(start_iteration, cfg.trainer.iterations):
        m = run_iteration(run, it, bar.stage)
        metrics.write(it, m)
        bar.iteration_done(it, m)
        last = it + 1 == cfg.trainer.iterations
        if (cfg.checkpoint.interval and (it + 1) % cfg.checkpoint.interval == 0) or last:
            state = {"iteration": it + 1, "origin": checkpoint.origin_of(cfg.checkpoint.resume),
                     "sampler": {"epoch": run.sampler.state.epoch, "offset": run.sampler.state.offset},
                     "rng": checkpoint.rng_state(), "model_path": cfg.model.path, "tokenizer_path": cfg.model.tokenizer_path or cfg.model.path}
            bar.stage("checkpoint")
            with long_phase(cfg.elastic.startup_timeout_s, cfg.elastic.collective_timeout_s):  # ranks' writes may be skewed by minutes
                folder = checkpoint.save(cfg.checkpoint.dir, it + 1, run.actor, state, cfg.checkpoint.keep)
            if rank0:
                log.info("saved checkpoint %s", folder)
    bar.close()
    metrics.close()
