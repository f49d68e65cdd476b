"""The colocated iteration under elastic replicas (the config's ``elastic.replicas``; the
mechanism is ``spmd_rl.elastic.replicas``'s docstring): each iteration runs on this replica's
share of the global batch and is redone, with the next generation's deal, when a replica is lost.

    take the replicas asking to join in (healing them)        # every member, same boundary;
                                                              # a joiner was healed just before
    run the iteration on the share (data.global_batch_size = the share's groups)
    on ReplicaLost: rewind the sampler, drop the iteration from the dock, agree on the
                    survivors, redo it

Nothing to undo in the training state: an iteration is one optimizer step
(``recipe.replica_rules``), taken only after every replica committed to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.distributed as dist

from spmd_rl.config.schema import Config
from spmd_rl.data.sampler import PromptSampler, SamplerState
from spmd_rl.elastic.replica_group import ReplicaLost, StateFn
from spmd_rl.elastic.replicas import Replicas
from spmd_rl.elastic.replicated_step import materialize, state_tensors
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


def heal_state(actor, sampler: PromptSampler, it: int) -> tuple[torch.Tensor, StateFn]:
    """(counter, state): what a replica healed from a member receives, one tensor at a time: the
    counter (the iteration, the sampler's place, the optimizer steps), then every parameter and
    optimizer state tensor of the actor, each overwritten in place by member 0's. A joiner whose
    optimizer has no state yet creates it (``materialize``) once the counter says the members'
    has, so both sides list the same tensors."""
    counter = torch.zeros(4, dtype=torch.float64)

    def now() -> torch.Tensor:
        s = sampler.state
        return counter.copy_(torch.tensor([it, s.epoch, s.offset, actor.step_count], dtype=torch.float64))

    def state() -> Iterator[torch.Tensor]:
        yield now()
        if int(counter[3]) > 0 and not actor.optimizer.state:
            materialize(actor.model, actor.optimizer)
        yield from state_tensors(actor.model, actor.optimizer)

    now()  # with no heal, the counter holds this replica's own place
    return counter, state


def _check_healed(run: Run, it: int, counter: torch.Tensor) -> None:
    """A member after a heal: member 0 was where this replica is (a survivor left out of a
    generation and healed back into the next one must be at the same step)."""
    done, epoch, offset, steps = (int(v) for v in counter.tolist())
    if done != it or steps != run.roles["actor"].step_count:
        raise RuntimeError(
            f"replica {run.replicas.group.replica} at iteration {it} (step {run.roles['actor'].step_count}) was "
            f"healed from a member at iteration {done} (step {steps}): restart it to join as a new replica"
        )
    run.sampler.state = SamplerState(epoch, offset)


def join_running(replicas: Replicas, actor, sampler: PromptSampler) -> int:
    """A replica arriving at a running job: heal the actor, its optimizer and the sampler from a
    member, with no checkpoint read, and catch the LR schedule up; returns the iteration the
    members are about to run, this replica's first."""
    counter, state = heal_state(actor, sampler, -1)
    replicas.join(state)
    it, epoch, offset, steps = (int(v) for v in counter.tolist())
    sampler.state = SamplerState(epoch, offset)
    for _ in range(steps - actor.step_count):
        actor.scheduler.step()
    actor.step_count = steps
    return it


def replicated_iteration(run: Run, it: int, on_stage: Callable[[str], None], iteration: Iteration) -> dict:
    """``iteration`` on this replica's share, redone until every replica of a generation got
    through it (module docstring); its metrics with the replicas' own."""
    reps, base = run.replicas, run.cfg
    start = SamplerState(run.sampler.state.epoch, run.sampler.state.offset)
    boundary = True
    while True:
        try:
            if boundary:  # a redo follows a recovery, which took in whoever asked
                boundary = False
                counter, state = heal_state(run.roles["actor"], run.sampler, it)
                if reps.take_joiners(state):
                    _check_healed(run, it, counter)
            return iteration(replace(run, cfg=share_config(base, reps.share_size())), it, on_stage) | reps.metrics()
        except ReplicaLost as exc:
            if run.peer.rank == 0:
                log.warning("iteration %d: %s; the surviving replicas redo it", it, exc)
            run.sampler.state = SamplerState(start.epoch, start.offset)
            dist.barrier()  # every rank of this replica is here: ReplicaLost is voted over them
            run.dock.commit(it)  # what the iteration wrote so far
            counter, state = heal_state(run.roles["actor"], run.sampler, it)
            reps.recover(state)
            _check_healed(run, it, counter)
            if run.peer.rank == 0:
                log.info("redoing iteration %d with %d replicas (generation %d)", it, reps.world, reps.generation)
