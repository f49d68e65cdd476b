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

- before each collective the members meet (``elastic.arrivals``) and wait for each other as long
  as every member's membership lease holds: a slow member is never taken for a lost one. A
  member whose lease lapses (a stopped node) or whose store refuses (a killed one), a gloo error
  (a peer's sockets closed), or a collective that outlasts ``timeout_s`` once all arrived
  raises ``ReplicaLost``; the caller redoes its step after ``recover()``. The defaults are the
  config's (``elastic.replicas.timeout_s``, ``elastic.startup_timeout_s``);
- ``should_commit``: an optimizer step is taken only when every member of the generation got
  through the step's collectives and says so (torchft's ``Manager.should_commit``: a MIN
  all-reduce of each member's flag); a failure in between is a "no" for everyone;
- a replica of several ranks (``local_pg``: the replica's own group, torchrun's) is one member:
  its local rank 0 alone holds the lease, the store and the quorum's side, and hands each
  decided generation to its local ranks; local rank ``i`` joins the column group of the local
  ranks ``i`` of all members (HSDP: each reduces the shard it holds), on the store prefix
  ``<job>/gen<k>/col<i>``. After every cross-replica collective the local ranks vote (MIN over
  ``local_pg``), so a failure seen by one column is a failure for the whole replica and all its
  ranks recover together;
- a generation with new members starts with ``heal``, which copies the state tensors from its
  first member (a survivor) to all: a replica that joins gets a survivor's state over the new
  group, with no checkpoint read. Members and joiners call it at the same point: members in
  ``recover``, when the agreed generation holds a replica the last one did not; joiners in
  ``join``;
- a split commit is healed too (torchft's quorum does it by ``max_step``): a commit vote that
  reached some members and failed on others leaves the first a step (an iteration) ahead. With
  ``progress`` (each member's place: iteration, steps), every new generation compares it over
  its members (MAX, MIN) and, when it differs or the generation has new members, heals all from
  the first member furthest ahead, not from member 0.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from spmd_rl.distributed import teardown
from spmd_rl.dock.errors import DockUnavailable
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.elastic.arrivals import Arrivals
from spmd_rl.elastic.quorum import Generation, LayoutMismatch, NotAMember, Quorum, QuorumLost, gone

_LOST = b"!quorum-lost:"
"""Prefix of the lead's answer when no generation could be agreed (``QuorumLost``'s message follows)."""
_MISMATCH = b"!layout:"
"""Prefix of the lead's answer when this replica's layout differs from the job's (``LayoutMismatch``)."""


StateFn = Callable[[], Iterable[torch.Tensor]]
"""What a joiner is healed with, asked anew for each heal: every tensor of the training state, in
one order on every replica (a generator may yield a counter first and decide the rest from it)."""


class ReplicaLost(RuntimeError):
    """A collective over the replicas failed: a peer died or stopped answering."""


class ReplicaGroup:
    def __init__(  # noqa: PLR0913
        self,
        store: MetadataStore,
        replica: str,
        host: str = "127.0.0.1",
        lease_s: float = 5.0,
        join_window_s: float = 1.0,
        min_replicas: int = 1,
        timeout_s: float = 120.0,
        local_pg: dist.ProcessGroup | None = None,
        quorum_timeout_s: float = 600.0,
        layout: dict | None = None,
        max_members: int | None = None,
    ):
        from torchft.process_group import ProcessGroupGloo  # 0.6 s of imports: only where replicas are elastic

        self.replica, self.job, self.local_pg, self.store = replica, store.job, local_pg, store
        self.local_rank = 0 if local_pg is None else local_pg.rank()
        self.quorum, self.tcp = None, None
        if self.local_rank == 0:  # the replica's lead: its lease, its store, its side of the quorum
            self.tcp = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
            address = f"{host}:{self.tcp.port}"
            self.quorum = Quorum(
                store, replica, address, lease_s, join_window_s, min_replicas, quorum_timeout_s, layout, max_members
            )
        self.max_members = max_members
        self.timeout_s, self.patience_s = timeout_s, quorum_timeout_s
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
        self.gen: Generation | None = None
        self.arrivals: Arrivals | None = None
        self._running = None
        """The gloo work of the collective in progress, if any."""
        self._abandoned: list[tuple[object, object]] = []
        """(group, work) of generations left while a collective still ran in them (a member stopped
        inside it): held until the work ends, as dropping a gloo group joins its worker thread,
        blocked until gloo's timeout."""
        self._torn = False
        """Whether a heal into this replica was cut short: its state is a mix of two members'."""
        self.places_differed = False
        """Whether the members of the last generation formed were at different places (a split
        commit, healed from the furthest)."""

    @property
    def rank(self) -> int:
        return self.gen.rank_of(self.replica)

    @property
    def world(self) -> int:
        return len(self.gen.members)

    def start(self, expected: int) -> Generation:
        """Register and agree on the first generation with ``expected`` replicas."""
        gen = self._decided(lambda q: (q.register(), q.agree(0, expected=expected))[1])
        return self._configure(gen)

    def join(self, state: StateFn, progress: torch.Tensor | None = None) -> Generation:
        """A replica arriving at a running job: register, ask for the next generation (the
        members agree on it at their next step boundary, ``joiners_waiting``) and overwrite
        ``state`` with a member's (``progress``: this replica's place, behind every member's)."""
        self._decided(lambda q: (q.register(), q.current())[1])
        return self._rejoin(state, progress)

    def running(self) -> bool:
        """Whether the job's replicas agreed on a generation already: this one must ``join``."""
        found = self.quorum is not None and self.quorum.latest() is not None
        return self._from_lead(torch.tensor([1.0 if found else 0.0])).item() > 0

    def joiners_waiting(self) -> bool:
        """Whether a replica asked for the next generation: every member checks at the same
        step boundary and, when one did, all call ``recover`` there (so all enter it)."""
        full = self.max_members is not None and self.world >= self.max_members  # joiners wait as spares
        asked = self.quorum is not None and not full and bool(self.quorum.asking(self.gen.number + 1))
        flag = self._from_lead(torch.tensor([1.0 if asked else 0.0]))
        return self.allreduce(flag, dist.ReduceOp.MAX).item() > 0

    def recover(self, state: StateFn, progress: torch.Tensor | None = None) -> Generation:
        """Agree on the next generation with whoever is here (survivors, and joiners that asked
        meanwhile), rebuild the group, and when it has new members, or (with ``progress``) its
        members are not all at one place, give all the state of the first member furthest
        ahead (``_heal_from_furthest``). A member of the new generation lost while it forms:
        agree on the one after. Left out of it (its peers decided before this replica asked):
        join the one after as a new replica does, healing ``state`` from a member."""
        if self.arrivals is not None:  # this generation is over: members waiting at its arrivals leave it too
            self.arrivals.leave()
        before, since = set(self.gen.members), time.monotonic()
        while True:
            try:
                gen = self._decided(lambda q: self._agree_within(q, self.gen.number + 1, since))
            except NotAMember:
                return self._rejoin(state, progress)
            try:
                self._configure(gen)
                self._heal_from_furthest(state, progress, grew=bool(set(gen.members) - before))
                return gen
            except (ReplicaLost, NotAMember):
                continue

    def _heal_from_furthest(self, state: StateFn, progress: torch.Tensor | None, grew: bool) -> None:
        """Every member and joiner of a new generation, at the same point: heal all from the
        first whole member whose ``progress`` is the furthest (element-wise MAX) when the
        generation grew, the members' progress differs, or a member's last heal was cut short
        (``_torn``: the source died mid-way; its counter came first, so its progress says
        nothing); without ``progress``, from the first whole member when it grew. No whole
        member: ``QuorumLost`` (the state is only in the checkpoints)."""
        any_torn = self.allreduce(torch.tensor([1.0 if self._torn else 0.0]), dist.ReduceOp.MAX).item() > 0
        mine = None
        if progress is not None:
            mine = progress.to(torch.float64).reshape(-1)
            place = torch.full_like(mine, -1.0) if self._torn else mine  # a torn member is at no place
            top, low = (
                self.allreduce(place.clone(), dist.ReduceOp.MAX),
                self.allreduce(place.clone(), dist.ReduceOp.MIN),
            )
            eligible = not self._torn and torch.equal(place, top)
            self.places_differed = not torch.equal(top, low)
        else:
            eligible, self.places_differed = not self._torn, False
        first = self.allreduce(torch.tensor([float(self.rank if eligible else self.world)]), dist.ReduceOp.MIN)
        src = int(first.item())
        if src >= self.world:
            raise QuorumLost(
                f"generation {self.gen.number}: no member holds a whole training state (a heal was cut short by its "
                "source's loss): restart the job from its checkpoint"
            )
        if grew or self.places_differed or any_torn:
            receiving = self.rank != src and (mine is None or self._torn or not torch.equal(mine, top))
            self._torn = self._torn or receiving
            self.heal(state(), src)
            self._torn = False

    def _rejoin(self, state: StateFn, progress: torch.Tensor | None = None) -> Generation:
        """Join the generation after the current one and heal from a member of it; a member lost
        while it forms or heals (the members recover the same way), or decided without this
        replica: join the one after."""
        since = time.monotonic()
        while True:
            before = self._decided(lambda q: q.current())
            try:
                gen = self._configure(self._decided(lambda q: self._agree_within(q, before.number + 1, since)))
                if gen.members[0] not in before.members:
                    raise QuorumLost(
                        f"generation {gen.number} {list(gen.members)} holds no replica of generation {before.number} "
                        f"to heal from: restart the job from its checkpoint"
                    )
                self._heal_from_furthest(state, progress, grew=True)
                return gen
            except (ReplicaLost, NotAMember):
                continue

    def _agree_within(self, quorum: Quorum, number: int, since: float) -> Generation:
        """``quorum.agree(number)`` unless generations have formed and broken since ``since`` for
        longer than ``quorum_timeout_s`` (``QuorumLost``): replicas that reach etcd but not
        each other (a partition between them, a replica publishing an address others cannot
        reach: ``dock.interface``) would otherwise form a new one every few seconds, forever.
        The lead decides, so every rank of the replica stops together."""
        if time.monotonic() - since > self.patience_s:
            raise QuorumLost(
                f"replica {self.replica}: no generation of replicas held together for {self.patience_s:g}s (each "
                "formed and broke: can every replica reach the others' dock.interface?): restart from the checkpoint"
            )
        return quorum.agree(number)

    def _decided(self, agree: Callable[[Quorum], Generation]) -> Generation:
        """``agree`` run by the lead, its answer handed to the replica's other ranks (JSON bytes
        over ``local_pg``, never pickle); ``NotAMember`` on all of them when it was left out."""
        payload = b""
        if self.quorum is not None:
            try:
                payload = agree(self.quorum).encode()
            except NotAMember:
                payload = b""
            except QuorumLost as exc:  # raised on every rank of the replica, not on the lead alone
                payload = _LOST + str(exc).encode()
            except LayoutMismatch as exc:
                payload = _MISMATCH + str(exc).encode()
        payload = self._bytes_from_lead(payload)
        if not payload:
            raise NotAMember(f"replica {self.replica} was left out of the generation its peers agreed on")
        if payload.startswith(_LOST):
            raise QuorumLost(payload[len(_LOST) :].decode())
        if payload.startswith(_MISMATCH):
            raise LayoutMismatch(payload[len(_MISMATCH) :].decode())
        return Generation.decode(payload)

    def _bytes_from_lead(self, payload: bytes) -> bytes:
        if self.local_pg is None:
            return payload
        size = self._from_lead(torch.tensor([len(payload)], dtype=torch.int64))
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)
        buf = self._from_lead(buf if self.local_rank == 0 else torch.empty(int(size.item()), dtype=torch.uint8))
        return buf.numpy().tobytes()

    def _from_lead(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.local_pg is not None:
            dist.broadcast(tensor, group=self.local_pg, group_src=0)
        return tensor

    def _configure(self, gen: Generation) -> Generation:
        self.gen, self.arrivals = gen, None
        column = "" if self.local_pg is None else f"/col{self.local_rank}"
        prefix = f"{self.job}/gen{gen.number}{column}"

        def form() -> None:
            self.pg.configure(
                f"{gen.store_address}/{prefix}", self.replica, gen.rank_of(self.replica), len(gen.members)
            )
            self.arrivals = Arrivals(
                gen.store_address, f"{prefix}/arrive", len(gen.members), self._gone, self.timeout_s, self.patience_s
            )

        self._voted(form, f"forming generation {gen.number} {list(gen.members)}", meet=False)
        return gen

    def _gone(self) -> list[str]:
        """The members of this generation no longer alive (``quorum.gone``); none while etcd
        cannot be read (no verdict: keep waiting)."""
        try:
            return gone(self.store, self.gen, self.replica)
        except DockUnavailable:
            return []

    def _voted(self, collective: Callable[[], None], what: str, meet: bool = True) -> None:
        """Run a cross-replica collective once every member arrived at it (``meet``:
        ``elastic.arrivals``); every rank of this replica learns whether all of theirs
        succeeded (MIN over ``local_pg``), and on a failure all raise ``ReplicaLost`` with this
        generation's group closed at once: a member blocked on this one (not on the dead one)
        sees its sockets close now, not when this one has agreed again; one waiting at an
        arrival sees the generation marked broken."""
        error = None
        try:
            if meet:
                self.arrivals.meet()
            collective()
        except (RuntimeError, socket.error) as exc:  # MemberLost, torch's DistError, gloo's errors
            error = exc
        ok = error is None
        if self.local_pg is not None:
            vote = torch.tensor([1.0 if ok else 0.0])
            dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self.local_pg)
            ok = vote.item() > 0
        if not ok:
            if self.arrivals is not None:
                self.arrivals.leave()
            self._abort()
            raise ReplicaLost(f"{what}: {error or 'another rank of this replica failed'}") from error

    def _abort(self) -> None:
        """Abort this generation's group, keeping it (``_abandoned``) while a collective runs in it."""
        self._abandoned = [(pg, work) for pg, work in self._abandoned if not work.is_completed()]
        if self._running is not None and not self._running.is_completed():
            self._abandoned.append((self.pg._pg, self._running))  # torchft's wrapper drops it in abort()
        self._running = None
        self.pg.abort()

    def _waited(self, work) -> None:
        """Wait for a collective as long as every member lives (``Arrivals.wait``); when that
        raises, ``_running`` stays set, so ``_abort`` keeps the group the work still runs in."""
        self._running = work
        self.arrivals.wait(work)
        self._running = None

    def allreduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place over this generation's members; ``ReplicaLost`` when a member is gone."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._voted(lambda: self._waited(self.pg.allreduce([tensor], opts)), f"generation {self.gen.number}")
        return tensor

    def should_commit(self, ok: bool = True) -> bool:
        """True on every member only when every member says ``ok``; False on a failure."""
        try:
            return self.allreduce(torch.tensor([1.0 if ok else 0.0]), dist.ReduceOp.MIN).item() > 0
        except ReplicaLost:
            return False

    def heal(self, tensors: Iterable[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` on every member with member ``src``'s (a joiner's state), one
        at a time: an iterator may decide what follows from what it already received."""
        what = f"healing in generation {self.gen.number}"
        self._voted(lambda: None, what)  # every member is here; the tensors then follow back to back
        for t in tensors:
            self._voted(lambda t=t: self._waited(self.pg.broadcast_one(t, src)), what, meet=False)

    def close(self) -> None:
        """Revoke the lease, drop the group and close the stores: the arrivals' client and, on
        the lead, its store server (its port refuses from now on). A group abandoned with its
        collective still running is held until the process exits (``keep_until_exit``)."""
        if self.quorum is not None:
            self.quorum.close()
        for kept in self._abandoned:
            if not kept[1].is_completed():
                teardown.keep_until_exit(kept, None)
        self.pg.shutdown()
        self.arrivals = None
        self.tcp = None
