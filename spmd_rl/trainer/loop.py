"""The SPMD iteration (paper Figure 1), identical on every rank: for each stage of the declared
graph (``recipe.graph``), make its roles resident and run it (``runner.run_stage``).

    [eval] -> (prompts -> actor_rollout -> reward) x rounds -> [ref_logprob] -> [actor_logprob]
           -> [critic_value] -> advantage -> [critic_update] -> actor_update -> commit
           -> [final eval, after the last iteration] -> [checkpoint]

The rounds before the update are the run's strategy, chosen once (``trainer.rounds``): one
round, DAPO's dynamic sampling (rounds until G groups carry signal; the later stages read only
the selected groups), or a partial rollout's round (``trainer.partial``: only the groups that
finished are rewarded and trained). With ``stream.fuse`` the fused stages
(``recipe.graph.fused_stages``) run inside the rollout on the groups already generated
(``trainer.fusion``) and are not run again after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch.distributed as dist

from spmd_rl.distributed import sides, timeline
from spmd_rl.distributed.timeouts import generation_phase
from spmd_rl.trainer import async_loop
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.driver import drive
from spmd_rl.trainer.evaluate import eval_accuracy
from spmd_rl.trainer.replica_loop import replicated_iteration
from spmd_rl.trainer.iteration_metrics import IterationMetrics
from spmd_rl.trainer.observed import trained_groups
from spmd_rl.trainer.metrics import StageTimer, global_maxes, throughput, truncate_from
from spmd_rl.trainer.runner import run_stage
from spmd_rl.trainer.rounds import Rounds, rounds_for

log = logging.getLogger("spmd_rl")


def run_iteration(run: Run, it: int, on_stage: Callable[[str], None] | None, rounds: Rounds) -> dict[str, float]:
    """One iteration (module docstring); ``rounds``: the run's strategy (``rounds_for``)."""
    cfg, timer, m = run.cfg, StageTimer(on_stage), IterationMetrics()
    t0 = time.perf_counter()
    with timeline.span("begin", "stage"):
        run.dock.begin_iteration(it, run.modes.generation_rounds * cfg.data.global_batch_size * cfg.rollout.n)
    with generation_phase(cfg):  # the collectives after generation wait for the slowest DP group
        if run.held_out is not None and it % cfg.trainer.eval_interval == 0:
            with timer.stage("eval"):
                run.residency.enter("eval", ("rollout",))
                m.final["eval_accuracy"] = eval_accuracy(run, it)
        train_idx, record = rounds(run, it, timer, m)
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
    colocated = partial(_colocated_iteration, rounds=rounds_for(run))  # the strategy, chosen once
    iteration = partial(colocated, run)
    if run.replicas is not None:  # redone by the survivors when a replica is lost
        iteration = partial(replicated_iteration, run, iteration=colocated)
    drive(run, start_iteration, run.peer.rank == 0, iteration)


def _colocated_iteration(run: Run, it: int, on_stage: Callable[[str], None], rounds: Rounds) -> dict[str, float]:
    """One iteration on every rank, and after the last the final held-out evaluation."""
    m = run_iteration(run, it, on_stage, rounds)
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
