"""Which replicas train together: numbered generations of the cross-replica membership, agreed
through etcd, with no coordinator process.

Keys, under the job's prefix (``MetadataStore.key``):

- ``elastic/members/<replica>``: ``{"address": "host:port", "pid": ...}`` under the replica's
  lease (``lease_s``, kept alive by a thread): present while the replica lives or has not yet
  been missed for ``lease_s``;
- ``elastic/join/<k>/<replica>``: the replica asks to be in generation ``k`` (under its lease);
- ``elastic/gen/<k>``: generation ``k``'s members and their store addresses. Written once
  (put-if-absent) and never changed: whoever reads it reads the same membership. The members of
  generation ``k - 1`` come first, then the new ones, each part sorted: member 0, whose state
  heals a joiner and whose store hosts the group, is a replica that has trained (unless every
  earlier member is gone, which ``ReplicaGroup`` refuses to heal from).

Agreement (``Quorum.agree``): generation ``k`` is decided by the smallest live replica among
those that asked for it, once every *alive* member of generation ``k - 1`` has asked, and then
every other alive replica too or ``join_window_s`` has passed. Alive: its membership lease holds
and its store still accepts a connection (``refuses``: a SIGKILLed process's port resets at
once, before its lease lapses, so the survivors of a kill need not wait for the lease). A member
that is only slow (it generates a longer share, it was paused for less than its lease) is
waited for, never dropped: liveness comes from the lease, not from how long others waited. A
member alive but silent for ``timeout_s`` (hung) is left out. Never decided by joiners alone
while a member of generation ``k - 1`` lives (the members ask at their next step boundary, and
the joiners heal from them). Fewer than ``min_replicas`` after ``timeout_s``: ``QuorumLost``,
and the job falls back to the checkpoint restart. When no process of generation ``k - 1`` lives
on (the whole job relaunched under its ``metadata.job``: ``_relaunched``), generation ``k``
waits for all of its replicas, as the first generation waits for ``count``, for up to half of
``timeout_s``. A generation takes at most ``max_members`` (the previous generation's members
first): a joiner beyond them is told it is not a member and waits as a spare. The lease is
renewed through the store's retry and endpoint failover, and a lease that lapsed anyway is
replaced and the record published again at once (``Quorum._keep_alive``): a live replica
unpublished would look relaunched to a joiner.

This is torchft's quorum (``torchft/manager.py``: ``Manager._async_quorum`` asking the
Lighthouse, which answers with the members that joined within its join timeout, at least
``min_replicas``) moved onto the etcd the job already runs: the Lighthouse is one more server to
place and keep alive, and torchft's Manager cannot take another quorum source.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from spmd_rl.dock.metadata import LeaseGone, MetadataStore

log = logging.getLogger("spmd_rl")

POLL_S = 0.02
"""Seconds between reads while a generation is being decided."""


class QuorumLost(RuntimeError):
    """Fewer than ``min_replicas`` replicas could agree: restart from the checkpoint instead."""


class LayoutMismatch(ValueError):
    """A replica's layout (its ranks, batch and algorithm: what a heal and the deal assume are
    the same everywhere) differs from a live member's: the job's replicas must run one config."""


class NotAMember(RuntimeError):
    """This replica is not in the generation its peers agreed on (it was missed): it must join
    again, as a new replica, and heal from a peer."""


@dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[str, ...]
    """Replica names, the previous generation's first (module docstring): a replica's rank in
    the cross-replica group is its index here."""
    addresses: dict[str, str]
    """Each member's store address (``host:port``)."""

    def rank_of(self, replica: str) -> int:
        return self.members.index(replica)

    def encode(self) -> bytes:
        return json.dumps({"number": self.number, "members": list(self.members), "addresses": self.addresses}).encode()

    @staticmethod
    def decode(raw: bytes) -> "Generation":
        d = json.loads(raw)
        return Generation(int(d["number"]), tuple(d["members"]), dict(d["addresses"]))

    @property
    def store_address(self) -> str:
        """The store this generation's process group meets on: its first member's."""
        return self.addresses[self.members[0]]


class Quorum:
    """One replica's side of the agreement (module docstring)."""

    def __init__(  # noqa: PLR0913
        self,
        store: MetadataStore,
        replica: str,
        address: str,
        lease_s: float = 5.0,
        join_window_s: float = 1.0,
        min_replicas: int = 1,
        timeout_s: float = 60.0,
        layout: dict | None = None,
        max_members: int | None = None,
    ):
        if "/" in replica or not replica:
            raise ValueError(f"replica name {replica!r}: must be non-empty and hold no '/'")
        self.store, self.replica, self.address = store, replica, address
        self.lease_s, self.join_window_s = lease_s, join_window_s
        self.min_replicas, self.timeout_s = min_replicas, timeout_s
        self.layout = layout or {}
        self.max_members = max_members
        """The most replicas a generation takes (the units of each mini-batch): joiners beyond
        it wait as spares, taken in when a member is lost."""
        self._lease = None
        self._stop = threading.Event()

    def _key(self, *parts: object) -> str:
        return self.store.key("elastic", *parts)

    def register(self) -> None:
        """Refuse a layout unlike a live member's (``LayoutMismatch``), then take a lease,
        publish this replica under it and keep it alive until ``close``. Once only."""
        if self._lease is not None:
            return
        self._check_layout()
        self._publish()
        threading.Thread(target=self._keep_alive, name="quorum-lease", daemon=True).start()

    def _check_layout(self) -> None:
        prefix = self._key("members") + "/"
        for key, raw in self.store.get_prefix(prefix):
            theirs = json.loads(raw).get("layout", {})
            differ = sorted(k for k in self.layout.keys() | theirs.keys() if self.layout.get(k) != theirs.get(k))
            if differ and key[len(prefix) :] != self.replica:
                raise LayoutMismatch(
                    f"replica {self.replica} differs from the job's replica {key[len(prefix) :]} in "
                    + ", ".join(f"{k} ({self.layout.get(k)!r} here, {theirs.get(k)!r} there)" for k in differ)
                    + ": every replica of a job must run the same config on the same number of ranks"
                )

    def _publish(self) -> None:
        self._lease = self.store.lease(max(1, round(self.lease_s)))
        record = json.dumps({"address": self.address, "pid": os.getpid(), "layout": self.layout}).encode()
        self.store.put(self._key("members", self.replica), record, lease=self._lease)

    def _renew(self) -> None:
        """A replica that did not run for longer than its lease (SIGSTOP, a long pause) lost
        the lease and its member record with it: publish again under a new one."""
        if self._lease.refresh() <= 0:
            self._publish()

    def _keep_alive(self) -> None:
        """Renew every ``lease_s / 3``; a lease that lapsed anyway (etcd away longer than it, this
        process stopped) is replaced and the record published again, so a live replica is never
        left unpublished (a joiner would take the job for relaunched and decide alone)."""
        while not self._stop.wait(self.lease_s / 3):
            try:
                self._renew()
            except Exception as exc:  # noqa: BLE001 - etcd away past the store's retry: the next beat retries
                log.warning("replica %s: renewing its membership lease failed: %r", self.replica, exc)

    def close(self) -> None:
        self._stop.set()
        if self._lease is not None:
            try:
                self._lease.revoke()
            except LeaseGone:  # lapsed already: its keys are gone
                pass

    def members(self) -> dict[str, str]:
        """Live replicas (lease not expired) -> store address."""
        return published(self.store)

    def latest(self) -> Generation | None:
        """The newest decided generation, or None before the first."""
        got = self.store.get_prefix(self._key("gen") + "/")
        return Generation.decode(got[-1][1]) if got else None

    def current(self) -> Generation:
        """The newest decided generation; ``QuorumLost`` before the first (nothing to join)."""
        got = self.latest()
        if got is None:
            raise QuorumLost("no generation of replicas has been agreed yet, so there is nothing to join")
        return got

    def asking(self, number: int) -> list[str]:
        """Replicas that asked to be in generation ``number``."""
        prefix = self._key("join", f"{number:08d}") + "/"
        return [k[len(prefix) :] for k, _ in self.store.get_prefix(prefix)]

    def agree(self, number: int, expected: int | None = None) -> Generation:
        """Ask to be in generation ``number`` and return it once decided (module docstring).
        ``expected``: for the first generation, wait for that many replicas instead of the
        join window. Raises ``NotAMember`` when decided without this replica."""
        self._renew()
        self.store.put(self._key("join", f"{number:08d}", self.replica), b"", lease=self._lease)
        asked_at = time.monotonic()
        before = self._generation(number - 1)
        old = set(before.members) if before else set()
        window_from = None if old else asked_at  # the join window runs once the last generation's live members asked
        members_from = None  # when the first member of the last generation was seen asking
        while True:
            decided = self.store.get(self._key("gen", f"{number:08d}"))
            if decided is not None:
                gen = Generation.decode(decided)
                if self.replica not in gen.members:
                    raise NotAMember(f"replica {self.replica} is not in generation {number}: {gen.members}")
                return gen
            asked, live = set(self.asking(number)), self.members()
            ready = asked & set(live)
            alive = ready | {r for r in set(live) - ready if not refuses(live[r])}
            if window_from is None and old & alive <= ready:
                window_from = time.monotonic()
            if members_from is None and old & ready:
                members_from = time.monotonic()
            want = expected
            if want is None and before is not None and _relaunched(before, live):
                # the whole job relaunched: wait for the last launch's replicas, for half the timeout
                want = len(old) if time.monotonic() - asked_at < self.timeout_s / 2 else self.min_replicas
            # a live member that has not asked timeout_s after the first member did is hung (not a joiner's wait)
            overdue = members_from is not None and time.monotonic() - members_from > self.timeout_s
            if ready and min(ready) == self.replica and self._decides(ready, alive, old, window_from, want, overdue):
                members = self._ordered(old, ready)[: self.max_members]
                gen = Generation(number, members, {r: live[r] for r in members})
                self.store.create(self._key("gen", f"{number:08d}"), gen.encode())
                continue  # read back what was written first, by this replica or another
            if time.monotonic() - asked_at > self.timeout_s and len(ready) < self.min_replicas:
                raise QuorumLost(
                    f"generation {number}: {len(ready)} replica(s) {sorted(ready)} agreed within "
                    f"{self.timeout_s:g}s, fewer than min_replicas={self.min_replicas}: restart from the checkpoint"
                )
            time.sleep(POLL_S)

    def _generation(self, number: int) -> Generation | None:
        """Generation ``number`` (None before the first)."""
        got = self.store.get(self._key("gen", f"{number:08d}")) if number >= 0 else None
        return Generation.decode(got) if got is not None else None

    @staticmethod
    def _ordered(old: set[str], ready: set[str]) -> tuple[str, ...]:
        """``ready`` with the previous generation's members (``old``) first (module docstring)."""
        return tuple(sorted(ready & old) + sorted(ready - old))

    def _decides(  # noqa: PLR0913
        self,
        ready: set[str],
        alive: set[str],
        old: set[str],
        window_from: float | None,
        expected: int | None,
        overdue: bool,
    ) -> bool:
        """Whether the smallest asker may write the generation now (module docstring). ``alive``:
        the replicas whose lease holds and whose process was not found gone (``refuses``);
        ``old``: the previous generation's members; ``window_from``: when every live one of them
        had asked; ``overdue``: ``timeout_s`` passed since the first of them asked (a live
        member that has not asked by then is hung, and is left out; a joiner's own wait for
        the members' boundary does not count)."""
        if len(ready) < self.min_replicas:
            return False
        if old & alive and not old & ready:  # joiners alone while members live: they take them in at a boundary
            return False
        if expected is not None:
            return len(ready) >= expected
        if overdue:
            return True
        if not old & alive <= ready:  # a live member not here yet is slow, not lost: wait for it
            return False
        return alive <= ready or (window_from is not None and time.monotonic() - window_from >= self.join_window_s)


def published(store: MetadataStore) -> dict[str, str]:
    """The replicas whose membership lease holds -> their store address (``host:port``)."""
    prefix = store.key("elastic", "members") + "/"
    return {k[len(prefix) :]: json.loads(v)["address"] for k, v in store.get_prefix(prefix)}


def refuses(address: str, timeout_s: float = 1.0) -> bool:
    """Whether nothing listens at a replica's store ``address`` any more: its process died and
    its host answers at once with a reset, before the lease it held lapses. A stopped or busy
    process still accepts (the kernel queues the connection) and a host that does not answer
    is not judged here: for both, the lease decides."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def gone(store: MetadataStore, gen: Generation, me: str) -> list[str]:
    """The members of ``gen`` other than ``me`` that are no longer alive: lease lapsed (or
    published again at another address: a new process), or the process found gone."""
    live = published(store)
    return [m for m in gen.members if m != me and (live.get(m) != gen.addresses[m] or refuses(gen.addresses[m]))]


def _relaunched(gen: Generation, live: dict[str, str]) -> bool:
    """Whether no process of generation ``gen`` is alive: none of its members is published at
    the address it had then (a replica relaunched under its name publishes a new one). The whole
    job was relaunched under its ``metadata.job`` (each replica from its checkpoint): the next
    generation waits for all of ``gen``'s replicas, as a first one waits for ``count``, so
    none starts training alone from an older checkpoint than its peers'."""
    return not any(live.get(m) == gen.addresses[m] for m in gen.members)
