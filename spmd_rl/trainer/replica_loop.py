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
iteration nothing is stepped before a loss. With several (``actor.ppo_epochs`` > 1,
``actor.mini_batch_size`` < G, or PPO's critic, which steps before the actor), the steps
committed before the loss are undone from the copy kept at the iteration's start
(``IterationStart``: this rank's shards of the actor's (and critic's) parameters and AdamW
moments on host, 3x the shards' fp32 bytes), so the survivors redo the whole iteration from the
state it started from, with the new deal.
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
from spmd_rl.trainer.ledger import StepRecord
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


TRAINED = ("actor", "critic")
"""The roles with an optimizer: their gradients are summed over the replicas, their state is
healed and kept (PPO's critic takes the actor's steps: the same epochs and mini-batches)."""


def trained(roles: dict) -> list:
    return [roles[r] for r in TRAINED if r in roles]


def make_resident(run: Run) -> Callable[[], None]:
    """Bring the trained engines' state on device (the residency manager's phase
    ``replica_state``): between stages a role may be on host with its device storage released,
    and the state is read or overwritten in place."""
    roles = tuple(r for r in TRAINED if r in run.roles)
    return lambda: run.residency.enter("replica_state", roles)


class IterationStart:
    """The trained engines' state as an iteration started, for a redo after a loss that came
    after some of their optimizer steps: every parameter and optimizer state tensor of this rank
    (``state_tensors``: the local shards) copied to host, the learning rates, the schedule and
    the step count of each. Kept only where an iteration takes several steps (``steps`` > 1,
    counted over every trained engine: PPO's critic steps before the actor, so with one actor
    step a loss between the two finds the critic a step ahead, and it must be put back too)."""

    def __init__(self, engines: list, steps: int, resident: Callable[[], None]):
        self.engines, self.steps, self.resident = engines, steps, resident
        self.kept: list[dict] = []  # none kept yet: a loss before this iteration's work

    def keep(self) -> None:
        if self.steps <= 1:
            return
        self.resident()
        self.kept = [
            {
                "had_state": bool(e.optimizer.state),
                "tensors": [t.detach().to("cpu", copy=True) for t in state_tensors(e.model, e.optimizer)],
                "lrs": [g["lr"] for g in e.optimizer.param_groups],
                "schedule": copy.deepcopy(e.scheduler.state_dict()),
                "steps": e.step_count,
            }
            for e in self.engines
        ]

    def restore(self) -> bool:
        """Put the kept state back; whether any step had been taken since ``keep``."""
        if not self.kept or all(e.step_count == k["steps"] for e, k in zip(self.engines, self.kept)):
            return False
        self.resident()
        for e, k in zip(self.engines, self.kept):
            e.optimizer.zero_grad(set_to_none=True)
            if not k["had_state"]:  # the first iteration: AdamW creates its moments again at its first step
                e.optimizer.state.clear()
            live = state_tensors(e.model, e.optimizer)
            if len(live) != len(k["tensors"]):
                raise RuntimeError(f"an engine holds {len(live)} state tensors, {len(k['tensors'])} were kept")
            with torch.no_grad():
                for t, saved in zip(live, k["tensors"]):
                    t.copy_(saved)
            for g, lr in zip(e.optimizer.param_groups, k["lrs"]):
                g["lr"] = lr
            e.scheduler.load_state_dict(k["schedule"])
            e.step_count = k["steps"]
        return True


def heal_state(
    engines: list, sampler: PromptSampler, it: int, resident: Callable[[], None] = lambda: None
) -> tuple[torch.Tensor, StateFn]:
    """(counter, state): what a replica healed from a member receives, one tensor at a time: the
    counter (the iteration, the sampler's place, the optimizer steps), then every parameter and
    optimizer state tensor of each trained engine, each overwritten in place by the healer's. A
    joiner whose optimizers have no state yet creates it (``materialize``) once the counter says
    the members' have, so both sides list the same tensors. ``resident`` runs first (a
    joiner's engines are all on device already)."""
    counter = torch.zeros(4, dtype=torch.float64)

    def now() -> torch.Tensor:
        s = sampler.state
        return counter.copy_(torch.tensor([it, s.epoch, s.offset, engines[0].step_count], dtype=torch.float64))

    def state() -> Iterator[torch.Tensor]:
        resident()
        yield now()
        for e in engines:
            if int(counter[3]) > 0 and not e.optimizer.state:
                materialize(e.model, e.optimizer)
            yield from state_tensors(e.model, e.optimizer)

    now()  # with no heal, the counter holds this replica's own place
    return counter, state


def progress_of(counter: torch.Tensor) -> torch.Tensor:
    """A replica's place, compared over a new generation's members (``ReplicaGroup``'s
    ``progress``): the iteration it is at and its optimizer steps."""
    return counter[[0, 3]].clone()


def adopt(engines: list, sampler: PromptSampler, counter: torch.Tensor) -> int:
    """After a heal: take the healer's place (``counter``): its sampler position and step count,
    each engine's LR schedule caught up to it; returns the iteration the healer was at."""
    it, epoch, offset, steps = (int(v) for v in counter.tolist())
    for e in engines:
        if steps < e.step_count:
            raise RuntimeError(f"healed from a replica {e.step_count - steps} optimizer steps behind this one")
        for _ in range(steps - e.step_count):
            e.scheduler.step()
        e.step_count = steps
    sampler.state = SamplerState(epoch, offset)
    return it


def _adopt_at(run: Run, it: int, counter: torch.Tensor) -> bool:
    """A member after its generation healed: at iteration ``it`` like the healer (redo it), or
    one ahead (True: a split commit, the others committed ``it`` and this replica's vote failed;
    the healed state is ``it``'s result)."""
    done = adopt(trained(run.roles), run.sampler, counter)
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
            "iteration %d: the other replicas committed it without this one (its commit vote failed, or they "
            "went on without it); healed to their state and skipping it (the first member records its share in "
            "its prompt ledger)",
            it,
        )
    return True


def join_running(replicas: Replicas, engines: list, sampler: PromptSampler, start: int) -> int:
    """A replica arriving at a running job: heal the trained engines, their optimizers and the
    sampler from the member furthest ahead, with no checkpoint read, and catch the LR schedules
    up; returns the iteration the members are about to run, this replica's first. ``start``: the
    iteration this replica resumed at (0 for a new one), its place in the comparison: when the
    whole job is relaunched under its ``metadata.job``, every replica finds the last launch's
    generation and joins, and all heal from the one whose checkpoint is the newest."""
    counter, state = heal_state(engines, sampler, start)
    replicas.join(state, progress_of(counter))
    return adopt(engines, sampler, counter)


def record_lost_shares(run: Run) -> None:
    """After a loss: the last iteration this replica committed was committed by every member of
    its generation (the commit vote is a MIN over all of them), so each member's share of it was
    trained, even a member whose own vote then failed (a split commit: it skips the iteration).
    A member lost since may have died before writing its ledger record, and one caught up never
    writes it. The first member of the new generation writes, for each member of that deal
    without a record of that iteration, its share (sampled = put = trained, ``rollout.n``
    samples per row; put-if-absent: a record the member wrote itself stays). Every member that
    went on had written its record before the loss, which came in a later iteration."""
    reps = run.replicas
    if reps.committed is None or run.ledger is None or run.peer.rank != 0 or reps.group.rank != 0:
        return
    it, rows, owners = reps.committed
    n = run.cfg.rollout.n
    for name in sorted(set(owners)):
        share = reps.share_of(name, rows, owners)
        record = StepRecord(it, share, share, put=share, trained_samples=len(share) * n, group_size=n)
        if run.ledger.of_replica(name, reps.group.replica).record_if_absent(record):
            log.warning("iteration %d: replica %s committed it and did not record it: recorded its share", it, name)


def replicated_iteration(run: Run, it: int, on_stage: Callable[[str], None], iteration: Iteration) -> dict:
    """``iteration`` on this replica's share, redone until every replica of a generation got
    through it (module docstring); its metrics with the replicas' own."""
    reps, base, engines = run.replicas, run.cfg, trained(run.roles)
    start = SamplerState(run.sampler.state.epoch, run.sampler.state.offset)
    resident = make_resident(run)
    kept = IterationStart(engines, len(engines) * base.actor.ppo_epochs * mini_batch_count(base), resident)
    boundary = True
    while True:
        try:
            if boundary:  # a redo follows a recovery, which took in whoever asked
                boundary = False
                counter, state = heal_state(engines, run.sampler, it, resident)
                if reps.take_joiners(state, progress_of(counter)) and _adopt_at(run, it, counter):
                    return reps.metrics() | {"replica_caught_up": 1.0}
            kept.keep()
            metrics = iteration(replace(run, cfg=share_config(base, reps)), it, on_stage)
            reps.commit(it)
            return metrics | reps.metrics()
        except ReplicaLost as exc:
            if run.peer.rank == 0:
                log.warning("iteration %d: %s; the surviving replicas redo it", it, exc)
            run.sampler.state = SamplerState(start.epoch, start.offset)
            if kept.restore():  # before the heal below, which may send it to a joiner
                run.residency.weights_changed()
            dist.barrier()  # every rank of this replica is here: ReplicaLost is voted over them
            run.dock.commit(it)  # what the iteration wrote so far
            counter, state = heal_state(engines, run.sampler, it, resident)
            reps.recover(state, progress_of(counter))
            record_lost_shares(run)
            if _adopt_at(run, it, counter):
                return reps.metrics() | {"replica_caught_up": 1.0}
            if run.peer.rank == 0:
                log.info("redoing iteration %d with %d replicas (generation %d)", it, reps.world, reps.generation)
