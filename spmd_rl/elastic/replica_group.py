"""The cross-replica process group of one replica, rebuilt in place when the membership changes.

A replica (a node, or a group of nodes: one data-parallel copy of the model) keeps its process,
its model and optimizer state and its engines across a peer's loss; only this group, the one
that spans replicas, is rebuilt. Each generation (``elastic.quorum``) gets a fresh gloo group on
a fresh store prefix (``<job>/gen<k>``) of the store its first member hosts: torchft's
reconfigurable ``ProcessGroupGloo`` (``torchft/process_group.py``: ``configure(store_addr,
replica_id, rank, world_size)`` aborts the old group and builds a new one), reused as it is.
torch 2.13's own ``init_process_group`` has no reconfiguration, and a gloo group cannot shrink.

Every replica hosts a store (a ``TCPStore`` server on a free port) from its start, so the first
member of any generation, a survivor by construction, already serves the next group's
rendezvous: no store lives on a node whose loss would take it down for everyone.

Invariants:

- a collective that fails (a peer's sockets closed: SIGKILL; or no answer within ``timeout_s``:
  a stopped node) raises ``ReplicaLost``; the caller redoes its step after ``recover()``;
- ``should_commit``: an optimizer step is taken only when every member of the generation got
  through the step's collectives and says so (torchft's ``Manager.should_commit``: a MIN
  all-reduce of each member's flag); a failure in between is a "no" for everyone;
- a generation with new members starts with ``heal``, which copies the state tensors from its
  first member (a survivor) to all: a replica that joins gets a survivor's state over the new
  group, with no checkpoint read. Members and joiners call it at the same point: members in
  ``recover``, when the agreed generation holds a replica the last one did not; joiners in
  ``join``.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
from torch.distributed import TCPStore

from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.elastic.quorum import Generation, NotAMember, Quorum


class ReplicaLost(RuntimeError):
    """A collective over the replicas failed: a peer died or stopped answering."""


class ReplicaGroup:
    def __init__(
        self,
        store: MetadataStore,
        replica: str,
        host: str = "127.0.0.1",
        lease_s: float = 5.0,
        join_window_s: float = 1.0,
        min_replicas: int = 1,
        timeout_s: float = 5.0,
    ):
        from torchft.process_group import ProcessGroupGloo  # 3 s of imports: only where replicas are elastic

        self.tcp = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        self.replica, self.job = replica, store.job
        self.quorum = Quorum(store, replica, f"{host}:{self.tcp.port}", lease_s, join_window_s, min_replicas)
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
        self.gen: Generation | None = None

    @property
    def rank(self) -> int:
        return self.gen.rank_of(self.replica)

    @property
    def world(self) -> int:
        return len(self.gen.members)

    def start(self, expected: int) -> Generation:
        """Register and agree on the first generation with ``expected`` replicas."""
        self.quorum.register()
        return self._configure(self.quorum.agree(0, expected=expected))

    def join(self, state: list[torch.Tensor]) -> Generation:
        """A replica arriving at a running job: register, ask for the next generation (the
        members agree on it at their next step boundary, ``joiners_waiting``) and overwrite
        ``state`` with the first member's."""
        self.quorum.register()
        return self._rejoin(state)

    def joiners_waiting(self) -> bool:
        """Whether a replica asked for the next generation: every member checks at the same
        step boundary and, when one did, all call ``recover`` there (so all enter it)."""
        flag = torch.tensor([1.0 if self.quorum.asking(self.gen.number + 1) else 0.0])
        return self.allreduce(flag, torch.distributed.ReduceOp.MAX).item() > 0

    def recover(self, state: list[torch.Tensor]) -> Generation:
        """Agree on the next generation with whoever is here (survivors, and joiners that asked
        meanwhile), rebuild the group, and when it has new members give them ``state``. A member
        of the new generation lost while it forms: agree on the one after. Left out of it (its
        peers decided before this replica asked): join the one after as a new replica does,
        healing ``state`` from a member."""
        before = set(self.gen.members)
        while True:
            try:
                gen = self.quorum.agree(self.gen.number + 1)
            except NotAMember:
                return self._rejoin(state)
            try:
                self._configure(gen)
                if set(gen.members) - before:
                    self.heal(state)
                return gen
            except ReplicaLost:
                continue

    def _rejoin(self, state: list[torch.Tensor]) -> Generation:
        latest = self.quorum.latest()
        gen = self._configure(self.quorum.agree(latest.number + 1))
        self.heal(state)
        return gen

    def _configure(self, gen: Generation) -> Generation:
        self.gen = gen
        address = f"{gen.store_address}/{self.job}/gen{gen.number}"
        try:
            self.pg.configure(address, self.replica, gen.rank_of(self.replica), len(gen.members))
        except (RuntimeError, socket.error) as exc:
            raise self._lost(f"forming generation {gen.number} {list(gen.members)}: {exc}") from exc
        return gen

    def allreduce(self, tensor: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
        """In place over this generation's members; ``ReplicaLost`` when a member is gone."""
        opts = torch.distributed.AllreduceOptions()
        opts.reduceOp = op
        try:
            self.pg.allreduce([tensor], opts).wait()
        except (RuntimeError, socket.error) as exc:
            raise self._lost(f"generation {self.gen.number} {list(self.gen.members)}: {exc}") from exc
        return tensor

    def _lost(self, what: str) -> ReplicaLost:
        """Close this generation's group at once: a member blocked on this one (not on the dead
        one) sees its sockets close now, not when this one has agreed on the next generation."""
        self.pg.abort()
        return ReplicaLost(what)

    def should_commit(self, ok: bool = True) -> bool:
        """True on every member only when every member says ``ok``; False on a failure."""
        try:
            return self.allreduce(torch.tensor([1.0 if ok else 0.0]), torch.distributed.ReduceOp.MIN).item() > 0
        except ReplicaLost:
            return False

    def heal(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite ``tensors`` on every member with the first member's (a joiner's state)."""
        for t in tensors:
            try:
                self.pg.broadcast_one(t, 0).wait()
            except RuntimeError as exc:
                raise self._lost(f"healing in generation {self.gen.number}: {exc}") from exc

    def close(self) -> None:
        self.quorum.close()
        self.pg.shutdown()
