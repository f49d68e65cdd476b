"""The one iteration driver of every rank that trains, colocated or separated:

    for it in [start, trainer.iterations):
        metrics = iteration(it)        # the colocated iteration, or the trainers' half of it
        log metrics (the leader)       # MetricsLog, the progress bar
        [checkpoint]                   # every checkpoint.interval, and after the last
        flush this rank's trace

The placements differ only in ``iteration`` (``trainer.loop`` and ``trainer.async_loop``);
logging, checkpoints and traces are this one loop's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from spmd_rl.distributed import sides, timeline
from spmd_rl.distributed.timeouts import long_phase
from spmd_rl.trainer import checkpoint
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.metrics import MetricsLog
from spmd_rl.trainer.partial import carried_rows
from spmd_rl.trainer.progress import progress_for

log = logging.getLogger("spmd_rl")

Iteration = Callable[[int, Callable[[str], None]], dict[str, float]]
"""(iteration, on_stage) -> that iteration's metrics; ``on_stage`` names the stage starting."""


def drive(run: Run, start: int, leader: bool, iteration: Iteration) -> None:
    """Run iterations ``start`` .. ``trainer.iterations - 1`` (module docstring); ``leader``
    writes the metrics and shows the progress bar."""
    cfg = run.cfg
    metrics = MetricsLog(
        cfg.logging.dir,
        cfg.logging.jsonl,
        cfg.logging.tensorboard,
        enabled=leader,
        start_iteration=start,
        wandb=cfg.logging.wandb,
        job=cfg.metadata.job,
        lineage=run.lineage,
        config=cfg.model_dump(mode="json", exclude={"dock": {"token"}}),
    )
    bar = progress_for(leader and cfg.logging.progress, cfg.trainer.iterations, start)
    for it in range(start, cfg.trainer.iterations):
        start_us = timeline.now_us()
        m = iteration(it, bar.stage)
        with timeline.span("log", "stage"):
            metrics.write(it, m)
            bar.iteration_done(it, m)
        trace = partial(timeline.flush, cfg.logging.dir, run.peer.rank, it, start_us)
        if (cfg.checkpoint.interval and (it + 1) % cfg.checkpoint.interval == 0) or it + 1 == cfg.trainer.iterations:
            bar.stage("checkpoint")
            t0 = timeline.now_us()

            def trace_with_checkpoint() -> None:
                """The iteration's trace line is on disk before its checkpoint completes: a kill
                in between resumes after this iteration and would never write its line again."""
                timeline.record("checkpoint", "stage", t0)
                trace()

            save_checkpoint(run, it + 1, before_commit=trace_with_checkpoint)
        else:
            trace()
    bar.close()
    metrics.close()


def save_checkpoint(run: Run, iteration: int, before_commit: Callable[[], None] | None = None) -> None:
    """Collective over the training roles: the checkpoint after ``iteration`` updates (the
    roles' state, the sampler, the RNGs, a partial rollout's carried rows); ``before_commit``:
    see ``checkpoint.save``."""
    cfg = run.cfg
    state = {
        "iteration": iteration,
        "origin": checkpoint.origin_of(cfg.checkpoint.resume),
        "lineage": run.lineage,
        "sampler": {"epoch": run.sampler.state.epoch, "offset": run.sampler.state.offset},
        "rng": checkpoint.rng_state(),
        "model_path": cfg.model.path,
        "tokenizer_path": cfg.model.tokenizer_path or cfg.model.path,
    }
    if cfg.actor.lora is not None:  # the actor's state is its adapters (export merges or writes them)
        state["lora"] = cfg.actor.lora.model_dump()
    if run.modes.partial_rollout:
        state["carry_rows"] = carried_rows(run)
    run.residency.enter("checkpoint", checkpoint.SAVED_ROLES)
    with long_phase(
        cfg.elastic.startup_timeout_s, cfg.elastic.collective_timeout_s
    ):  # ranks' writes may be skewed by minutes
        folder = checkpoint.save(cfg.checkpoint.dir, iteration, run.roles, state, cfg.checkpoint.keep, before_commit)
    if run.peer.rank == sides.side_leader():
        log.info("saved checkpoint %s", folder)
