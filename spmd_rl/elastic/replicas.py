"""Elastic replicas in the trainer (``elastic.replicas``): each replica is one torchrun job (a node
or a group of nodes) with its own process group, dock, logs and checkpoints, holding the whole
model; the replicas train ONE global batch of G prompt groups together.

Per iteration (``trainer.replica_loop``):

- deal: every replica's sampler hands out the same G rows; they are cut into units of U groups
  (U = lcm of the replica's generation and training DP sizes, so a share splits evenly over its
  ranks) and replica r of the generation's W takes units j = r (mod W):
  ``share_r = [unit_j : j mod W = r]``;
- objective: the mini-batch normaliser (response tokens, sequences) is summed over the replicas
  (``sum``), so a replica's loss is its share of the one objective over the global batch, and
- gradient: the replicas' gradients are summed (``replicated_step.sum_gradients`` as the
  engine's ``gradient_sync``: one all-reduce of the flattened local shards over the replica's
  column group, HSDP) and applied only when every member got through (``should_commit``):

      g = sum_r grad( sum_{i in share_r} l_i / norm_global ) = grad( sum_i l_i / norm_global )

  the single-replica objective, whatever W is, up to the summation order;
- loss: a collective across replicas raises ``ReplicaLost`` on every rank of every survivor; the
  survivors agree on the next generation and redo the iteration with the new deal (nothing was
  stepped: the step follows the commit). At an iteration's start a replica asking to join (or a
  survivor its peers left out) is taken in and healed with a member's state.

The cross-replica group is torchft's reconfigurable gloo group (``elastic.replica_group``); the
membership is agreed through the job's etcd (``elastic.quorum``).
"""

from __future__ import annotations

import torch

from spmd_rl.elastic.replica_group import ReplicaGroup, StateFn


class Replicas:
    """This replica's side of the job's replicas, as the trainer uses them (module docstring)."""

    def __init__(self, group: ReplicaGroup, global_batch: int, unit: int):
        self.group, self.global_batch, self.unit = group, global_batch, unit
        self.redone = 0
        """Iterations this replica redid after a peer's loss."""
        self._joined = False

    @property
    def world(self) -> int:
        return self.group.world

    @property
    def generation(self) -> int:
        return self.group.gen.number

    def _units(self) -> list[int]:
        """The units (of ``unit`` groups) this replica takes in the current generation."""
        mine = list(range(self.group.rank, self.global_batch // self.unit, self.world))
        if not mine:
            raise RuntimeError(
                f"replica {self.group.replica}: {self.world} replicas share {self.global_batch // self.unit} units of "
                f"{self.unit} prompt groups and none is left for it; raise data.global_batch_size or run fewer replicas"
            )
        return mine

    def share_size(self) -> int:
        """Prompt groups of this replica's share."""
        return self.unit * len(self._units())

    def deal(self, rows: list[int]) -> list[int]:
        """This replica's rows of the iteration's ``global_batch`` rows (module docstring)."""
        if len(rows) != self.global_batch:
            raise ValueError(f"dealing {len(rows)} rows, not the global batch of {self.global_batch}")
        return [rows[j * self.unit + k] for j in self._units() for k in range(self.unit)]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the replicas, in place; ``ReplicaLost`` when a member is gone."""
        return self.group.allreduce(tensor)

    def start(self, count: int) -> None:
        """The job's first generation: wait for ``count`` replicas."""
        self.group.start(expected=count)

    def join(self, state: StateFn) -> None:
        """Join a running job: ask for the next generation, which the members agree on at their
        next iteration's start (``take_joiners``) or while recovering from a loss, and receive
        ``state`` from member 0. The joiner starts that iteration as the members do: after the
        heal, with no check for joiners of its own."""
        self.group.join(state)
        self._joined = True

    def take_joiners(self, state: StateFn) -> bool:
        """At an iteration's start, on every member: take in the replicas asking to join, healing
        them with ``state``; whether the membership changed."""
        if self._joined:  # the members took this replica in at this very boundary
            self._joined = False
            return False
        if not self.group.joiners_waiting():
            return False
        self.group.recover(state)
        return True

    def recover(self, state: StateFn) -> None:
        """After ``ReplicaLost``: agree on the next generation with the survivors (and joiners)."""
        self.redone += 1
        self.group.recover(state)

    def metrics(self) -> dict[str, float]:
        return {
            "replicas": float(self.world),
            "replica_generation": float(self.generation),
            "replica_redone": float(self.redone),
        }

    def close(self) -> None:
        self.group.close()
