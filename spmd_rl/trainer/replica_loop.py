"""The colocated iteration under elastic replicas (the config's ``elastic.replicas``; the
mechanism is ``spmd_rl.elastic.replicas``'s docstring): each iteration runs on this replica's
share of the global batch and is redone, with the next generation's deal, when a replica is lost.

    take the replicas asking to join in (healing them)        # every member, same boundary;
                                                              # a joiner was healed just before
    keep the actor's state if the iteration takes several optimizer steps
    run the iteration on the share (data.global_batch_size = the share's groups, its
                                    mini-batches its parts of the global ones)
    on ReplicaLost: rewind the sampler, put back the kept state, drop the iteration from the
                    dock, agree on the survivors, redo it

Each optimizer step is taken only after every replica committed to it, so with one step per
iteration nothing is stepped before a loss. With several (``actor.ppo_epochs`` > 1 or
``actor.mini_batch_size`` < G), the steps committed before the loss are undone from the copy
kept at the iteration's start (``IterationStart``: this rank's shards of the parameters and
AdamW moments on host, 3x the shards' fp32 bytes), so the survivors redo the whole iteration
from the state it started from, with the new deal.
"""

from __future__ import annotations

import copy
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
from spmd_rl.trainer.stages.minibatch import mini_batch_count

log = logging.getLogger("spmd_rl")

Iteration = Callable[[Run, int, Callable[[str], None]], dict[str, float]]


def share_config(cfg: Config, reps: Replicas) -> Config:
    """``cfg`` for this replica's share of the current generation: its batch and mini-batches."""
    return cfg.model_copy(
        update={
            "data": cfg.data.model_copy(update={"global_batch_size": reps.share_size()}),
            "actor": cfg.actor.model_copy(update={"mini_batch_size": reps.share_mini_batch()}),
        }
    )


class IterationStart:
    """The actor's training state as an iteration started, for a redo after a loss that came
    after some of its optimizer steps: every parameter and optimizer state tensor of this rank
    (``state_tensors``: the local shards) copied to host, the learning rates, the schedule and
    the step count. Kept only where an iteration takes several steps (``steps`` > 1)."""

    def __init__(self, actor, steps: int):
        self.actor, self.steps = actor, steps
        self.saved: list[torch.Tensor] = []
        self.step_count: int | None = None  # none kept yet: a loss before this iteration's work

    def keep(self) -> None:
        if self.steps <= 1:
            return
        a = self.actor
        self.had_state = bool(a.optimizer.state)
        self.saved = [t.detach().to("cpu", copy=True) for t in state_tensors(a.model, a.optimizer)]
        self.lrs = [g["lr"] for g in a.optimizer.param_groups]
        self.schedule = copy.deepcopy(a.scheduler.state_dict())
        self.step_count = a.step_count

    def restore(self) -> bool:
        """Put the kept state back; whether any step had been taken since ``keep``."""
        a = self.actor
        if self.step_count is None or a.step_count == self.step_count:
            return False
        a.optimizer.zero_grad(set_to_none=True)
        if not self.had_state:  # the first iteration: AdamW creates its moments again at its first step
            a.optimizer.state.clear()
        live = state_tensors(a.model, a.optimizer)
        if len(live) != len(self.saved):
            raise RuntimeError(f"the actor holds {len(live)} state tensors, {len(self.saved)} were kept")
        with torch.no_grad():
            for t, kept in zip(live, self.saved):
                t.copy_(kept)
        for g, lr in zip(a.optimizer.param_groups, self.lrs):
            g["lr"] = lr
        a.scheduler.load_state_dict(self.schedule)
        a.step_count = self.step_count
        return True


def heal_state(actor, sampler: PromptSampler, it: int) -> tuple[torch.Tensor, StateFn]:
    """(counter, state): what a replica healed from a member receives, one tensor at a time: the
    counter (the iteration, the sampler's place, the optimizer steps), then every parameter and
    optimizer state tensor of the actor, each overwritten in place by the healer's. A joiner whose
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


def progress_of(counter: torch.Tensor) -> torch.Tensor:
    """A replica's place, compared over a new generation's members (``ReplicaGroup``'s
    ``progress``): the iteration it is at and its optimizer steps."""
    return counter[[0, 3]].clone()


def adopt(actor, sampler: PromptSampler, counter: torch.Tensor) -> int:
    """After a heal: take the healer's place (``counter``): its sampler position and step count,
    the LR schedule caught up to it; returns the iteration the healer was at."""
    it, epoch, offset, steps = (int(v) for v in counter.tolist())
    if steps < actor.step_count:
        raise RuntimeError(f"healed from a replica {actor.step_count - steps} optimizer steps behind this one")
    sampler.state = SamplerState(epoch, offset)
    for _ in range(steps - actor.step_count):
        actor.scheduler.step()
    actor.step_count = steps
    return it


def _adopt_at(run: Run, it: int, counter: torch.Tensor) -> bool:
    """A member after its generation healed: at iteration ``it`` like the healer (redo it), or
    one ahead (True: a split commit, the others committed ``it`` and this replica's vote failed;
    the healed state is ``it``'s result)."""
    done = adopt(run.roles["actor"], run.sampler, counter)
    if done not in (it, it + 1):
        raise RuntimeError(
            f"replica {run.replicas.group.replica} at iteration {it} was healed from a member at iteration {done}: "
            "restart it to join as a new replica"
        )
    if done != it + 1:
        return False
    run.replicas.caught_up()
    run.residency.weights_changed()  # the engines hold this replica's weights from before the heal
    if run.peer.rank == 0:
        log.warning(
            "iteration %d: the other replicas committed it and this one's commit vote failed; healed to their "
            "state (its share of the iteration is not in this replica's prompt ledger)",
            it,
        )
    return True


def join_running(replicas: Replicas, actor, sampler: PromptSampler) -> int:
    """A replica arriving at a running job: heal the actor, its optimizer and the sampler from a
    member, with no checkpoint read, and catch the LR schedule up; returns the iteration the
    members are about to run, this replica's first."""
    counter, state = heal_state(actor, sampler, -1)
    replicas.join(state, progress_of(counter))
    return adopt(actor, sampler, counter)


def replicated_iteration(run: Run, it: int, on_stage: Callable[[str], None], iteration: Iteration) -> dict:
    """``iteration`` on this replica's share, redone until every replica of a generation got
    through it (module docstring); its metrics with the replicas' own."""
    reps, base, actor = run.replicas, run.cfg, run.roles["actor"]
    start = SamplerState(run.sampler.state.epoch, run.sampler.state.offset)
    kept = IterationStart(actor, base.actor.ppo_epochs * mini_batch_count(base))
    boundary = True
    while True:
        try:
            if boundary:  # a redo follows a recovery, which took in whoever asked
                boundary = False
                counter, state = heal_state(actor, run.sampler, it)
                if reps.take_joiners(state, progress_of(counter)):
                    _adopt_at(run, it, counter)
            kept.keep()
            return iteration(replace(run, cfg=share_config(base, reps)), it, on_stage) | reps.metrics()
        except ReplicaLost as exc:
            if run.peer.rank == 0:
                log.warning("iteration %d: %s; the surviving replicas redo it", it, exc)
            run.sampler.state = SamplerState(start.epoch, start.offset)
            if kept.restore():  # before the heal below, which may send it to a joiner
                run.residency.weights_changed()
            dist.barrier()  # every rank of this replica is here: ReplicaLost is voted over them
            run.dock.commit(it)  # what the iteration wrote so far
            counter, state = heal_state(actor, run.sampler, it)
            reps.recover(state, progress_of(counter))
            if _adopt_at(run, it, counter):
                return reps.metrics() | {"replica_caught_up": 1.0}
            if run.peer.rank == 0:
                log.info("redoing iteration %d with %d replicas (generation %d)", it, reps.world, reps.generation)
