"""Elastic replicas in the trainer (``elastic.replicas``): each replica is one torchrun job (a node
or a group of nodes) with its own process group, dock, logs and checkpoints, holding the whole
model; the replicas train ONE global batch of G prompt groups together.

Per iteration (``trainer.replica_loop``):

- deal: every replica's sampler hands out the same G rows, mini-batch m being the groups
  [m B, (m + 1) B) (B = ``actor.mini_batch_size``); each mini-batch is cut into units of U
  groups (U = lcm of the replica's generation and training DP sizes, so a share splits evenly
  over its ranks) and replica r of the generation's W takes units i = r (mod W) of every
  mini-batch: ``share_r = [unit_(m, i) : m < G / B, i mod W = r]``, mini-batch by mini-batch, so
  its mini-batches are all of one size (its ``actor.mini_batch_size``) and its mini-batch m
  holds its part of the global mini-batch m;
- objective: each mini-batch's normaliser (response tokens, sequences) is summed over the
  replicas (``sum``), so a replica's loss is its share of the one objective over the global
  mini-batch, and
- gradient: the replicas' gradients are summed (``replicated_step.sum_gradients`` as the
  engine's ``gradient_sync``: one all-reduce of the flattened local shards over the replica's
  column group, HSDP) and applied only when every member got through (``should_commit``):

      g_m = sum_r grad( sum_{i in share_r, m} l_i / norm_m ) = grad( sum_{i in m} l_i / norm_m )

  the single-replica objective, whatever W is, up to the summation order;
- loss: a collective across replicas raises ``ReplicaLost`` on every rank of every survivor; the
  survivors agree on the next generation and redo the iteration with the new deal, from the
  state it started from (with one optimizer step per iteration nothing was stepped: the step
  follows the commit; with several, the steps committed before the loss are undone,
  ``trainer.replica_loop.IterationStart``). At an iteration's start a replica asking to join
  (or a survivor its peers left out) is taken in and healed with a member's state.

The cross-replica group is torchft's reconfigurable gloo group (``elastic.replica_group``); the
membership is agreed through the job's etcd (``elastic.quorum``).
"""

from __future__ import annotations

from typing import Any

import torch

from spmd_rl.elastic.replica_group import ReplicaGroup, StateFn


class FinishedGroups:
    """The prompt groups this rank generated in the current iteration, by (the iteration's
    seed, the group's seed key): its redo after a peer's loss takes them from here instead of
    generating them again. A group's samples depend only on its seed key, the iteration's seed
    and the weights, all three the same in the redo (``trainer.stages.rollout``), so the redo
    trains what an uninterrupted run would. A new seed (the next iteration) empties it."""

    def __init__(self):
        self.seed: int | None = None
        self.groups: dict[int, Any] = {}
        self.reused = 0
        """Groups taken from here in the current iteration."""

    def begin(self, seed: int) -> None:
        if seed != self.seed:
            self.seed, self.groups, self.reused = seed, {}, 0


class Replicas:
    """This replica's side of the job's replicas, as the trainer uses them (module docstring)."""

    def __init__(self, group: ReplicaGroup, global_batch: int, mini_batch: int, unit: int):
        if global_batch % mini_batch or mini_batch % unit:
            raise ValueError(f"{global_batch} groups in mini-batches of {mini_batch} do not cut into units of {unit}")
        self.group, self.global_batch, self.mini_batch, self.unit = group, global_batch, mini_batch, unit
        self.redone = 0
        """Iterations this replica redid after a peer's loss."""
        self._skip_boundary = False
        self._owners: list[str] | None = None
        """The redo's deal: the replica of each unit place of a mini-batch (``_sticky``); None:
        the generation's round-robin."""
        self.finished = FinishedGroups()
        self.dealing: tuple[list[int], list[str]] | None = None
        """The current iteration's rows and the replica of each unit place (``deal``)."""
        self.committed: tuple[int, list[int], list[str]] | None = None
        """The last committed iteration, its rows and its deal: a member lost after it
        committed may not have recorded its share (``trainer.replica_loop``)."""

    @property
    def world(self) -> int:
        return self.group.world

    @property
    def generation(self) -> int:
        return self.group.gen.number

    def _units(self) -> list[int]:
        """The units (of ``unit`` groups) this replica takes of each mini-batch in the current
        generation, by their place in the mini-batch."""
        per_mini = self.mini_batch // self.unit
        mine = [i for i, owner in enumerate(self._dealt()) if owner == self.group.replica]
        if not mine:
            raise RuntimeError(
                f"replica {self.group.replica}: {self.world} replicas share each mini-batch's {per_mini} units of "
                f"{self.unit} prompt groups and none is left for it; raise actor.mini_batch_size or run fewer replicas"
            )
        return mine

    def share_size(self) -> int:
        """Prompt groups of this replica's share."""
        return self.share_mini_batch() * (self.global_batch // self.mini_batch)

    def share_mini_batch(self) -> int:
        """Prompt groups of each of this replica's mini-batches."""
        return self.unit * len(self._units())

    def deal(self, rows: list[int]) -> list[int]:
        """This replica's rows of the iteration's ``global_batch`` rows (module docstring); the
        whole deal is kept (``dealing``) until the iteration commits or is redone."""
        if len(rows) != self.global_batch:
            raise ValueError(f"dealing {len(rows)} rows, not the global batch of {self.global_batch}")
        self._units()  # none left for this replica: the fix, by name
        self.dealing = (list(rows), self._dealt())
        return self.share_of(self.group.replica, *self.dealing)

    def share_of(self, replica: str, rows: list[int], owners: list[str]) -> list[int]:
        """``replica``'s rows of a deal (``owners``: the replica of each unit place)."""
        return [
            rows[m * self.mini_batch + i * self.unit + k]
            for m in range(self.global_batch // self.mini_batch)
            for i, owner in enumerate(owners)
            if owner == replica
            for k in range(self.unit)
        ]

    def commit(self, iteration: int) -> None:
        """Iteration ``iteration`` committed on every member with the deal dealt last."""
        self.committed = (iteration, *self.dealing) if self.dealing is not None else None
        self.dealing = None

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the replicas, in place; ``ReplicaLost`` when a member is gone."""
        return self.group.allreduce(tensor)

    def start(self, count: int) -> None:
        """The job's first generation: wait for ``count`` replicas."""
        self.group.start(expected=count)

    def join(self, state: StateFn, progress: torch.Tensor) -> None:
        """Join a running job: ask for the next generation, which the members agree on at their
        next iteration's start (``take_joiners``) or while recovering from a loss, and receive
        ``state`` from the member furthest ahead (``progress``: this one's place, behind all).
        The joiner starts that iteration as the members do: after the heal, with no check for
        joiners of its own."""
        self.group.join(state, progress)
        self._skip_boundary = True

    def _dealt(self) -> list[str]:
        """The replica of each unit place of a mini-batch in the current deal."""
        members, per_mini = self.group.gen.members, self.mini_batch // self.unit
        return list(self._owners) if self._owners is not None else [members[i % len(members)] for i in range(per_mini)]

    def _sticky(self, before: list[str], number: int) -> list[str] | None:
        """The redo's deal after a loss, from the failed attempt's (``before``, in generation
        ``number``): each survivor keeps its unit places, so the groups it generated are in its
        share again (``finished``); the lost replicas' places go round-robin over the new
        generation. Only when every member knew the failed deal and gets a place: the new
        generation directly follows it, holds no replica new to it and its members were at
        one place (no split commit); else None (the round-robin)."""
        gen = self.group.gen
        if gen.number != number + 1 or set(gen.members) - set(before) or self.group.places_differed:
            return None
        lost = [i for i, owner in enumerate(before) if owner not in gen.members]
        owners = list(before)
        for k, i in enumerate(lost):
            owners[i] = gen.members[k % len(gen.members)]
        return owners if set(owners) == set(gen.members) else None

    def take_joiners(self, state: StateFn, progress: torch.Tensor) -> bool:
        """At an iteration's start, on every member: take in the replicas asking to join, healing
        them with ``state``; whether the membership changed. The deal is the generation's
        round-robin again."""
        self._owners = None
        if self._skip_boundary:  # the members took this replica in at this very boundary (or it caught up)
            self._skip_boundary = False
            return False
        if not self.group.joiners_waiting():
            return False
        self.group.recover(state, progress)
        return True

    def caught_up(self) -> None:
        """This replica was healed past an iteration its peers committed (a split commit): they
        redo the next one with no boundary check, and so does it."""
        self._skip_boundary = True

    def recover(self, state: StateFn, progress: torch.Tensor) -> None:
        """After ``ReplicaLost``: agree on the next generation with the survivors (and joiners),
        all healed from the furthest member when their ``progress`` differs (a split commit);
        the redo is dealt so that the survivors keep their groups (``_sticky``)."""
        before, number = self._dealt(), self.group.gen.number
        self.redone += 1
        self.group.recover(state, progress)
        self._owners = self._sticky(before, number)

    def metrics(self) -> dict[str, float]:
        return {
            "replicas": float(self.world),
            "replica_generation": float(self.generation),
            "replica_redone": float(self.redone),
            "replica_reused_groups": float(self.finished.reused),
        }

    def close(self) -> None:
        self.group.close()
