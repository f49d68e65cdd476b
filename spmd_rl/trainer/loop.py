"""The SPMD iteration (paper Figure 1), identical on every rank: for each stage of the declared
graph (``recipe.graph``), make its roles resident and run it (``runner.run_stage``).

    [eval] -> (prompts -> actor_rollout -> reward) x rounds -> [ref_logprob] -> [actor_logprob]
           -> [critic_value] -> advantage -> [critic_update] -> actor_update -> commit
           -> [final eval, after the last iteration] -> [checkpoint]

With ``stream.fuse`` the fused stages (``recipe.graph.fused_stages``) run inside the rollout
on the groups already generated (``trainer.fusion``) and are not run again after it. With
``stream.partial_tokens`` the round is ``trainer.partial``'s: only the groups that finished are
rewarded and trained.

The per-round stages repeat while DAPO dynamic sampling still lacks G prompt groups with
signal (``algos.dynamic_sampling``); the later stages read only the selected groups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch.distributed as dist

from spmd_rl.algos.dynamic_sampling import GroupSelection
from spmd_rl.distributed import sides, timeline
from spmd_rl.distributed.timeouts import generation_phase
from spmd_rl.trainer import async_loop
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.driver import drive
from spmd_rl.trainer.evaluate import eval_accuracy
from spmd_rl.trainer.fusion import run_fused
from spmd_rl.trainer.partial import partial_round
from spmd_rl.trainer.replica_loop import replicated_iteration
from spmd_rl.trainer.iteration_metrics import IterationMetrics
from spmd_rl.trainer.ledger import StepRecord
from spmd_rl.trainer.observed import trained_groups
from spmd_rl.trainer.metrics import StageTimer, global_maxes, throughput, truncate_from
from spmd_rl.trainer.runner import run_stage
from spmd_rl.trainer.stages.samples import put_prompts

log = logging.getLogger("spmd_rl")


def _next_rows(run: Run, groups: int) -> list[int]:
    """The round's dataset rows: the sampler's next ``groups``, or with elastic replicas this
    replica's deal of the next global batch (``Replicas.deal``; ``groups`` is then its share)."""
    if run.replicas is None:
        return run.sampler.next_batch(groups)
    return run.replicas.deal(run.sampler.next_batch(run.replicas.global_batch))


def _rounds(run: Run, it: int, timer: StageTimer, m: IterationMetrics) -> tuple[list[int], StepRecord]:
    """Round r's prompt p is group r * G + p, its samples (r * G + p) * N + k. Returns the
    sample indices the later stages train on, and the iteration's prompt accounting."""
    if run.modes.partial_rollout:
        return partial_round(run, it, timer, m)
    G, N = run.cfg.data.global_batch_size, run.cfg.rollout.n
    select = GroupSelection(G) if run.modes.dynamic_sampling else None
    rows: list[int] = []  # dataset row of group q, as the sampler handed it out
    put: list[int] = []  # and as the putters wrote it
    for r in range(run.modes.generation_rounds):
        expected = list(range(r * G * N, (r + 1) * G * N))
        with timer.stage("prompts"):
            rows += _next_rows(run, G)
            put += put_prompts(run, it, rows[r * G :], first_group=r * G)
        inside = [run.graph[0], *run.fused] if run.fused else []  # the rollout with the stages fused into it
        results = run_fused(run, it, run.graph[0], run.fused, expected, timer) if run.fused else []
        results += [run_stage(run, it, s, expected, timer) for s in run.graph if s.per_round and s not in inside]
        for res in results:
            m.add(res)
        if select is None:
            return list(range(G * N)), StepRecord(
                it, rows, [], put=put
            )  # trained: what the update reads (run_iteration)
        rewards = next(res.rewards for res in results if res.rewards is not None)
        dist.all_reduce(rewards)
        select.add_round(list(range(r * G, (r + 1) * G)), rewards, N)
        if select.done:
            break
    groups, short = select.final()
    if short and run.peer.rank == 0:
        log.warning(
            "dynamic sampling: only %d of %d groups carried signal after %d rounds; topped up with %d constant groups "
            "(raise algorithm.max_extra_rounds)",
            G - short,
            G,
            select.rounds,
            short,
        )
    m.final |= {
        "dapo_rounds": select.rounds,
        "dapo_kept_groups": G - short,
        "dapo_discarded_groups": select.rounds * G - G + short,
        "dapo_filler_groups": short,
    }
    kept = set(groups)
    signal = set(select.kept)
    dropped = {
        str(rows[q]): "dynamic sampling: "
        + ("beyond the iteration's G groups with signal" if q in signal else "constant reward in its group")
        for q in range(len(rows))
        if q not in kept
    }
    return [q * N + k for q in groups for k in range(N)], StepRecord(it, rows, [], dropped=dropped, put=put)


def run_iteration(run: Run, it: int, on_stage: Callable[[str], None] | None = None) -> dict[str, float]:
    cfg, timer, m = run.cfg, StageTimer(on_stage), IterationMetrics()
    t0 = time.perf_counter()
    with timeline.span("begin", "stage"):
        run.dock.begin_iteration(it, run.modes.generation_rounds * cfg.data.global_batch_size * cfg.rollout.n)
    with generation_phase(cfg):  # the collectives after generation wait for the slowest DP group
        if run.held_out is not None and it % cfg.trainer.eval_interval == 0:
            with timer.stage("eval"):
                run.residency.enter("eval", ("rollout",))
                m.final["eval_accuracy"] = eval_accuracy(run, it)
        train_idx, record = _rounds(run, it, timer, m)
    if not train_idx and run.peer.rank == 0:
        log.warning("iteration %d: no prompt group finished within stream.partial_tokens; no update", it)
    consumed: list[tuple[int, int]] = []
    for stage in run.graph:
        if train_idx and not stage.per_round and stage not in run.fused:
            res = run_stage(run, it, stage, train_idx, timer)
            m.add(res)
            consumed += res.consumed or []
    # the ledger's "trained" is what the update read, not the selection above (trainer.observed)
    size = run.modes.generation_rounds * cfg.data.global_batch_size * cfg.rollout.n
    record.trained, record.trained_samples = trained_groups(consumed, size, cfg.rollout.n)
    record.group_size = cfg.rollout.n
    with timeline.span("commit", "stage"):
        dist.barrier()
        run.dock.commit(it)
        if run.ledger is not None and run.peer.rank == 0:
            run.ledger.record(record)
    seconds = time.perf_counter() - t0
    with timeline.span("metrics", "stage"):
        return _metrics(run, timer, m, train_idx, seconds)


def _metrics(
    run: Run, timer: StageTimer, m: IterationMetrics, train_idx: list[int], seconds: float
) -> dict[str, float]:
    """Collective: the iteration's metrics, reduced over the ranks."""
    cfg = run.cfg
    out = m.finish() | {"world": run.lay.world, "samples": len(train_idx), "iteration_s": seconds}
    ran = [s.name for s in run.graph if s.name in timer.times]  # partial rollout may train nothing
    # the largest rank's memory; the slowest and fastest rank's rollout stage (their gap is how
    # long the fastest waited: the most a better balance of the generation work could save)
    gen_s = timer.times.get(run.graph[0].name, 0.0)
    out |= global_maxes(
        run.residency.iteration_memory(ran) | {"generation_s_max": gen_s}, mins={"generation_s_min": gen_s}
    )
    out["throughput_eq5"] = throughput(
        cfg.data.global_batch_size,
        cfg.rollout.n,
        cfg.data.max_prompt_length,
        cfg.rollout.max_response_length,
        run.lay.world,
        seconds,
    )
    return out | {f"time_{k}": v for k, v in timer.times.items()}


def train(run: Run, start_iteration: int) -> None:
    """This rank's part of the run: the colocated iteration on every rank, or under the separated
    placement the generators' loop or the trainers' (``trainer.async_loop``)."""
    # a resumed run redoes the iterations from start_iteration: each rank drops their spans, as
    # rank 0 drops their metrics lines (MetricsLog), so the trace shows each iteration once
    truncate_from(Path(run.cfg.logging.dir) / "trace" / f"rank{run.peer.rank}.jsonl", start_iteration)
    side = sides.current().side
    if side == "gen":
        return async_loop.generate(run, start_iteration)
    if side == "train":
        return async_loop.train_side(run, start_iteration)
    iteration = partial(_colocated_iteration, run)
    if run.replicas is not None:  # redone by the survivors when a replica is lost
        iteration = partial(replicated_iteration, run, iteration=_colocated_iteration)
    drive(run, start_iteration, run.peer.rank == 0, iteration)


def _colocated_iteration(run: Run, it: int, on_stage: Callable[[str], None]) -> dict[str, float]:
    """One iteration on every rank, and after the last the final held-out evaluation."""
    m = run_iteration(run, it, on_stage)
    if it + 1 == run.cfg.trainer.iterations and run.held_out is not None:
        m["final_eval_accuracy"] = final_eval(run, on_stage)
    return m


def final_eval(run: Run, on_stage: Callable[[str], None]) -> float:
    """Collective: held-out greedy accuracy of the policy after the last update (the weights the
    last checkpoint holds), logged as ``final_eval_accuracy`` on the last iteration's row."""
    on_stage("eval")
    with timeline.span("eval", "stage"), generation_phase(run.cfg):
        run.residency.enter("eval", ("rollout",))  # syncs the updated weights into the engine
        return eval_accuracy(run, run.cfg.trainer.iterations)
