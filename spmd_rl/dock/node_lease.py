"""Liveness keys under one lease per node: ``/<job>/alive/<rank>`` for every rank of the node and
``/<job>/warehouse_alive/<node>`` for its warehouse all expire with the lease of the node's lead
(local rank 0), which alone renews it. The node's other ranks beat on the lead's presence board
(``dock.presence``: a ``pwrite`` into shared memory, no etcd call) and the lead reconciles the
keys with the board.

Why: a lease per rank cost etcd one keep-alive per rank and second, 1.25 R/s with the
warehouses', and through the JSON gateway each keep-alive is a gRPC stream opened and closed
(``tools/bench_control_plane.py``: at 256 ranks on one host the gateway answered 503 and live
ranks' leases lapsed). One lease per node costs S keep-alives per second. etcd's gRPC proxy
coalesces keep-alives for the same reason (etcd-io/etcd#6912).

Invariants, as the peer watch (``dock.heartbeat.PeerWatch``) sees the keys:
- a rank's key exists from its ``start`` until its node's lease expires (the lead is gone or
  stopped) or, for a rank other than the lead, until its beat is ``ttl_s`` old (the lead
  deletes the key; a rank that beats again gets it back from the lead);
- the warehouse's key exists while its server thread runs and the lease holds (the lead deletes
  it at once when the server stops, its rank alive);
- a lease that lapsed (etcd away longer than ``ttl_s``) is replaced and every key whose owner
  still beats is put again under the new one.

So a lost rank is seen within ``ttl_s`` plus a beat as before; a lost lead takes its node's keys
with it. Under torchrun that is what happens anyway: a worker's death makes its agent stop the
node's other workers. A rank that cannot open the board (another pid namespace) holds a lease
of its own (``dock.heartbeat.Heartbeat``), as every rank did before.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence

from spmd_rl.dock.errors import DockTimeout
from spmd_rl.dock.heartbeat import Heartbeat, beat_every
from spmd_rl.dock.metadata import LeaseGone, LeaseId, MetadataStore
from spmd_rl.dock.presence import PresenceBoard, PresenceUnavailable

log = logging.getLogger(__name__)

RECORD = "node_lease"
"""``/<job>/node_lease/<node>``: the lead's lease id and board (JSON), under the lease itself."""


class NodeLease:
    """The lead's side: the node's lease, its board, and the keys under it."""

    def __init__(
        self,
        meta: MetadataStore,
        node: int,
        ranks: Sequence[int],
        ttl_s: int,
        board_name: str,
        warehouse: int | None = None,
        healthy: Callable[[], bool] | None = None,
    ):
        """``ranks``: the node's global ranks by local rank (``ranks[0]`` is this one);
        ``board_name``: the job's ``presence_name``; ``warehouse``: the node index of the
        warehouse this rank serves, whose key is deleted once ``healthy`` returns False."""
        self.meta, self.node, self.ranks, self.ttl_s = meta, node, list(ranks), ttl_s
        self.warehouse, self.healthy = warehouse, healthy
        self.board = PresenceBoard.create(len(self.ranks), board_name)
        self._withdrawn: set[int] = set()
        """Local ranks whose key this lead deleted because their beat went stale."""
        self._watching_since = self._last_look = time.monotonic()
        """Since when this lead has looked at the board without a gap of its own, and when last."""
        self._lease = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-lease", daemon=True)

    def start(self) -> "NodeLease":
        self._register()
        self._thread.start()
        return self

    def _register(self) -> None:
        """A new lease; under it, this rank's key, every other rank's that beats, the
        warehouse's while it serves, and the record the node's ranks find it by."""
        self._lease = lease = self.meta.lease(self.ttl_s)
        ages = self.silent_for()
        self._withdrawn = {i for i in range(1, len(self.ranks)) if self.ttl_s <= ages[i] < float("inf")}
        for i, rank in enumerate(self.ranks):
            if i == 0 or ages[i] < self.ttl_s:
                self.meta.put(self.meta.key("alive", rank), b"1", lease=lease)
        if self.warehouse is not None:
            self.meta.put(self.meta.key("warehouse_alive", self.warehouse), b"1", lease=lease)
        record = {"lease": lease.id, "board": self.board.ref()}
        self.meta.put(self.meta.key(RECORD, self.node), json.dumps(record).encode(), lease=lease)

    def _reconcile(self) -> None:
        """Withdraw the warehouse's key once it stops serving, a rank's once it has not beaten
        for ``ttl_s`` of this lead's own watching; put back the key of a withdrawn rank that
        beats again. Nothing once stopped (the dock stops its warehouse right after)."""
        if self._stop.is_set():
            return
        if self.warehouse is not None and self.healthy is not None and not self.healthy():
            log.warning("warehouse of node %d is unhealthy: withdrawing its liveness key", self.warehouse)
            self.meta.delete(self.meta.key("warehouse_alive", self.warehouse))
            self.warehouse = None
        for i, age in enumerate(self.silent_for()):
            if i == 0 or age == float("inf"):
                continue
            if age >= self.ttl_s and i not in self._withdrawn:
                log.warning("rank %d has not beaten for %.1f s: withdrawing its liveness key", self.ranks[i], age)
                self.meta.delete(self.meta.key("alive", self.ranks[i]))
                self._withdrawn.add(i)
            elif age < self.ttl_s and i in self._withdrawn:
                self.meta.put(self.meta.key("alive", self.ranks[i]), b"1", lease=self._lease)
                self._withdrawn.discard(i)

    def silent_for(self) -> list[float]:
        """Per local rank, the seconds without a beat that this lead itself watched: the board's
        age, counted from no earlier than the end of this lead's last gap (a look more than
        two beats after the one before). A host that froze the whole process (every thread of
        it, ``tools/bench_control_plane.py`` at 256 ranks on 2 cores: 17-36 s) shows every slot
        old to the first thread that wakes; no rank of the node was seen silent meanwhile.
        etcd treats its own leases alike: a new leader extends every lease before it expires
        any (its lessor's ``Promote``)."""
        now = time.monotonic()
        if now - self._last_look > 2 * beat_every(self.ttl_s) + 0.5:
            self._watching_since = now
        self._last_look = now
        watched = now - self._watching_since
        return [age if age == float("inf") else min(age, watched) for age in self.board.ages(now)]

    def _run(self) -> None:
        """Closes the board when it stops (never under a reconcile still running)."""
        try:
            while not self._stop.wait(beat_every(self.ttl_s)):
                try:
                    self._reconcile()
                    if self._lease.refresh() <= 0:  # expired (etcd was away too long): take a new one
                        self._register()
                except Exception as exc:  # the waiting stage reports the consequence
                    log.warning("node lease of node %d failed: %r", self.node, exc)
        finally:
            self.board.close()

    def stop(self) -> None:
        self._stop.set()


class RankBeat:
    """A rank other than its node's lead: beats on the lead's board; its key rides on the
    node's lease."""

    record_grace_s = 3.0
    """How long a record whose board cannot be opened is read again before this rank takes a
    lease of its own (a record of a lead that just restarted is replaced within it)."""

    def __init__(
        self, meta: MetadataStore, node: int, rank: int, local_rank: int, ttl_s: int, wait_s: float, board_name: str
    ):
        """``wait_s``: how long ``start`` waits for the lead's record; ``board_name``: the
        job's ``presence_name``."""
        self.meta, self.node, self.rank, self.local_rank, self.ttl_s = meta, node, rank, local_rank, ttl_s
        self.wait_s, self.board_name = wait_s, board_name
        self.board: PresenceBoard | None = None
        self.own: Heartbeat | None = None
        """This rank's own lease, when the board could not be opened."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="presence-beat", daemon=True)

    def start(self) -> "RankBeat":
        """Beat, then put this rank's key under the node's lease (so the key exists when
        ``start`` returns); a lease that lapsed in between is looked up again. A start that
        fails closes the board it opened."""
        try:
            return self._start()
        except BaseException:
            if self.board is not None and not self._thread.is_alive():
                self.board.close()
            raise

    def _start(self) -> "RankBeat":
        deadline = time.monotonic() + self.wait_s
        first_seen = None
        while True:
            record = self._record(deadline)
            first_seen = first_seen or time.monotonic()
            try:
                if self.board is None:
                    self.board = PresenceBoard.open(record["board"], self.board_name)
            except PresenceUnavailable as exc:
                if time.monotonic() < min(deadline, first_seen + self.record_grace_s):
                    time.sleep(0.2)  # the record of a lead that is gone: its successor publishes anew
                    continue
                log.warning("rank %d holds a liveness lease of its own: %s", self.rank, exc)
                self.own = Heartbeat(self.meta, self.rank, self.ttl_s).start()
                return self
            self.board.beat(self.local_rank)
            try:
                self.meta.put(self.meta.key("alive", self.rank), b"1", lease=LeaseId(int(record["lease"])))
            except LeaseGone:  # the lead is taking a new lease: its record is about to change
                if time.monotonic() > deadline:
                    raise DockTimeout(
                        f"rank {self.rank}: the liveness lease of node {self.node} lapsed and was not renewed within "
                        f"{self.wait_s:.0f}s: is that node's local rank 0 running?"
                    ) from None
                time.sleep(0.2)
                continue
            self._thread.start()
            return self

    def _record(self, deadline: float) -> dict:
        """The lead's record, waited for until ``deadline``."""
        raw = self.meta.wait_for(self.meta.key(RECORD, self.node), max(0.0, deadline - time.monotonic()))
        if raw is None:
            raise DockTimeout(
                f"rank {self.rank}: no liveness lease of node {self.node} after {self.wait_s:.0f}s: is that "
                "node's local rank 0 running?"
            )
        return json.loads(raw)

    def _run(self) -> None:
        try:
            while not self._stop.wait(beat_every(self.ttl_s)):
                self.board.beat(self.local_rank)
        finally:
            self.board.close()

    def stop(self) -> None:
        self._stop.set()
        if self.board is not None and not self._thread.is_alive():  # never beat from its thread: close here
            self.board.close()
        if self.own is not None:
            self.own.stop()
