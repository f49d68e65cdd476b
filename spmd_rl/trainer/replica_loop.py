"""The colocated iteration under elastic replicas (``elastic.replicas``, ``elastic.replicas``'s
module docstring): each iteration runs on this replica's share of the global batch and is redone,
with the next generation's deal, when a replica is lost.

    take the replicas asking to join in (healing them)        # every member, same boundary
    run the iteration on the share (data.global_batch_size = the share's groups)
    on ReplicaLost: rewind the sampler, drop the iteration from the dock, agree on the
                    survivors, redo it

Nothing to undo in the training state: an iteration is one optimizer step
(``recipe.replica_rules``), taken only after every replica committed to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from spmd_rl.config.schema import Config
from spmd_rl.data.sampler import SamplerState
from spmd_rl.elastic.replica_group import ReplicaLost
from spmd_rl.elastic.replicated_step import state_tensors
from spmd_rl.trainer.context import Run

log = logging.getLogger("spmd_rl")

Iteration = Callable[[Run, int, Callable[[str], None]], dict[str, float]]


def share_config(cfg: Config, groups: int) -> Config:
    """``cfg`` for a share of ``groups`` prompt groups: its batch and its one mini-batch."""
    return cfg.model_copy(
        update={
            "data": cfg.data.model_copy(update={"global_batch_size": groups}),
            "actor": cfg.actor.model_copy(update={"mini_batch_size": groups}),
        }
    )


def _heal_state(run: Run, it: int) -> tuple[torch.Tensor, Callable[[], list[torch.Tensor]]]:
    """(counter, state): what a replica healed from a member receives, read when a heal starts:
    the counter (the iteration, the sampler's place, the optimizer steps), then every parameter
    and optimizer state tensor of the actor, all overwritten in place by the member's."""
    actor, counter = run.roles["actor"], torch.zeros(4, dtype=torch.float64)

    def state() -> list[torch.Tensor]:
        s = run.sampler.state
        counter.copy_(torch.tensor([it, s.epoch, s.offset, actor.step_count], dtype=torch.float64))
        return [counter, *state_tensors(actor.model, actor.optimizer)]

    return counter, state


def _apply_healed(run: Run, it: int, counter: torch.Tensor) -> None:
    """After a heal: take the member's sampler place; a member at another step cannot be joined
    mid-run by this replica (it must restart and join as a new one)."""
    done, epoch, offset, steps = (int(v) for v in counter.tolist())
    if done != it or steps != run.roles["actor"].step_count:
        raise RuntimeError(
            f"replica {run.replicas.group.replica} at iteration {it} (step {run.roles['actor'].step_count}) was "
            f"healed from a member at iteration {done} (step {steps}): restart it to join as a new replica"
        )
    run.sampler.state = SamplerState(epoch, offset)


def replicated_iteration(run: Run, it: int, on_stage: Callable[[str], None], iteration: Iteration) -> dict:
    """``iteration`` on this replica's share, redone until every replica of a generation got
    through it (module docstring); its metrics with the replicas' own."""
    reps, base = run.replicas, run.cfg
    start = SamplerState(run.sampler.state.epoch, run.sampler.state.offset)
    counter, state = _heal_state(run, it)
    while True:
        try:
            if reps.take_joiners(state):
                _apply_healed(run, it, counter)
            return iteration(replace(run, cfg=share_config(base, reps.share_size())), it, on_stage) | reps.metrics()
        except ReplicaLost as exc:
            if run.peer.rank == 0:
                log.warning("iteration %d: %s; the surviving replicas redo it", it, exc)
            run.sampler.state = SamplerState(start.epoch, start.offset)
            dist.barrier()  # every rank of this replica is here: ReplicaLost is voted over them
            run.dock.commit(it)  # what the iteration wrote so far
            reps.recover(state)
            _apply_healed(run, it, counter)
