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
those that asked for it, once every live member has asked (a node that stops answering drops
out when its lease expires), or once ``join_window_s`` has passed since the first member of
generation ``k - 1`` was seen asking (its own ask, for a member) and at least ``min_replicas``
have asked (a SIGKILLed node's lease outlives it; its peers see the
dead sockets at once and need not wait for the lease); never by joiners alone while a member of
generation ``k - 1`` lives (the members ask at their next step boundary, and the joiners heal
from them). Fewer than ``min_replicas`` after ``timeout_s``: ``QuorumLost``, and the job falls
back to the checkpoint restart. When no process of generation ``k - 1`` lives on (the whole job
relaunched under its ``metadata.job``: ``_relaunched``), generation ``k`` waits for all of its
replicas, as the first generation waits for ``count``, for up to half of ``timeout_s``.

This is torchft's quorum (``torchft/manager.py``: ``Manager._async_quorum`` asking the
Lighthouse, which answers with the members that joined within its join timeout, at least
``min_replicas``) moved onto the etcd the job already runs: the Lighthouse is one more server to
place and keep alive, and torchft's Manager cannot take another quorum source.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

from spmd_rl.dock.metadata import MetadataStore

POLL_S = 0.02
"""Seconds between reads while a generation is being decided."""


class QuorumLost(RuntimeError):
    """Fewer than ``min_replicas`` replicas could agree: restart from the checkpoint instead."""


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

    def __init__(
        self,
        store: MetadataStore,
        replica: str,
        address: str,
        lease_s: float = 5.0,
        join_window_s: float = 1.0,
        min_replicas: int = 1,
        timeout_s: float = 60.0,
    ):
        if "/" in replica or not replica:
            raise ValueError(f"replica name {replica!r}: must be non-empty and hold no '/'")
        self.store, self.replica, self.address = store, replica, address
        self.lease_s, self.join_window_s = lease_s, join_window_s
        self.min_replicas, self.timeout_s = min_replicas, timeout_s
        self._lease = None
        self._stop = threading.Event()

    def _key(self, *parts: object) -> str:
        return self.store.key("elastic", *parts)

    def register(self) -> None:
        """Take a lease, publish this replica under it and keep it alive until ``close``."""
        self._publish()
        threading.Thread(target=self._keep_alive, name="quorum-lease", daemon=True).start()

    def _publish(self) -> None:
        self._lease = self.store.lease(max(1, round(self.lease_s)))
        record = json.dumps({"address": self.address, "pid": os.getpid()}).encode()
        self.store.put(self._key("members", self.replica), record, lease=self._lease)

    def _renew(self) -> None:
        """A replica that did not run for longer than its lease (SIGSTOP, a long pause) lost
        the lease and its member record with it: publish again under a new one."""
        if self._lease.refresh() <= 0:
            self._publish()

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self._lease.refresh()
            except Exception:  # noqa: BLE001 - etcd away for a moment: the next refresh retries
                pass

    def close(self) -> None:
        self._stop.set()
        if self._lease is not None:
            self._lease.revoke()

    def members(self) -> dict[str, str]:
        """Live replicas (lease not expired) -> store address."""
        prefix = self._key("members") + "/"
        return {k[len(prefix) :]: json.loads(v)["address"] for k, v in self.store.get_prefix(prefix)}

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
        window_from = None if old else asked_at  # the join window runs from the first member's ask
        while True:
            decided = self.store.get(self._key("gen", f"{number:08d}"))
            if decided is not None:
                gen = Generation.decode(decided)
                if self.replica not in gen.members:
                    raise NotAMember(f"replica {self.replica} is not in generation {number}: {gen.members}")
                return gen
            asked, live = set(self.asking(number)), self.members()
            ready = asked & set(live)
            if window_from is None and ready & old:
                window_from = time.monotonic()
            want = expected
            if want is None and before is not None and _relaunched(before, live):
                # the whole job relaunched: wait for the last launch's replicas, for half the timeout
                want = len(old) if time.monotonic() - asked_at < self.timeout_s / 2 else self.min_replicas
            if ready and min(ready) == self.replica and self._decides(ready, set(live), old, window_from, want):
                gen = Generation(number, self._ordered(old, ready), {r: live[r] for r in ready})
                self.store.create(self._key("gen", f"{number:08d}"), gen.encode())
                continue  # read back what was written first, by this replica or another
            if time.monotonic() - asked_at > self.timeout_s:
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

    def _decides(
        self, ready: set[str], live: set[str], old: set[str], window_from: float | None, expected: int | None
    ) -> bool:
        """Whether the smallest asker may write the generation now (module docstring); ``old``: the
        previous generation's members, ``window_from``: when the first of them was seen asking."""
        if len(ready) < self.min_replicas:
            return False
        if old & live and not old & ready:  # joiners alone while members live: they take them in at a boundary
            return False
        if expected is not None:
            return len(ready) >= expected
        return live <= ready or (window_from is not None and time.monotonic() - window_from >= self.join_window_s)


def _relaunched(gen: Generation, live: dict[str, str]) -> bool:
    """Whether no process of generation ``gen`` is alive: none of its members is published at
    the address it had then (a replica relaunched under its name publishes a new one). The whole
    job was relaunched under its ``metadata.job`` (each replica from its checkpoint): the next
    generation waits for all of ``gen``'s replicas, as a first one waits for ``count``, so
    none starts training alone from an older checkpoint than its peers'."""
    return not any(live.get(m) == gen.addresses[m] for m in gen.members)
