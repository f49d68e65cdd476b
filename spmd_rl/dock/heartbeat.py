"""Liveness in etcd: ``/<job>/alive/<rank>`` for every rank and ``/<job>/warehouse_alive/<node>``
for every warehouse, under leases (``dock.node_lease``: one per node). When the owner dies the
key expires after ``ttl_s``; when a warehouse's server thread stops (its rank still alive) its
key is deleted at once. A stage waiting on metadata or fetching from a warehouse then fails
with DockUnavailable naming what was lost, so the process exits non-zero and torchrun restarts
the group instead of waiting forever. :class:`PeerWatch` extends that bound to waits nothing
else can interrupt (a collective). :class:`Heartbeat` is one key under a lease of its own: a
rank that cannot reach its node's presence board holds its key that way."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from spmd_rl.dock.metadata import MetadataStore

log = logging.getLogger(__name__)


def beat_every(ttl_s: int) -> float:
    """Renewals and beats every second at most, ``ttl_s / 3`` at least: on a host so loaded that
    a thread waits seconds for its turn, a renewal every ``ttl_s / 3`` (etcd's own client's pace)
    let leases of live ranks expire (``tools/bench_control_plane.py`` at 128 ranks on 2 cores),
    and a rank declared lost ends the whole job."""
    return min(1.0, ttl_s / 3)


class Heartbeat:
    """``/<job>/alive/<rank>`` under a lease of this rank's own, renewed every ``beat_every``."""

    def __init__(self, meta: MetadataStore, rank: int, ttl_s: int = 10):
        self.meta = meta
        self.rank = rank
        self.ttl_s = ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._lease = None

    def _register(self) -> None:
        self._lease = self.meta.lease(self.ttl_s)
        self.meta.put(self.meta.key("alive", self.rank), b"1", lease=self._lease)

    def start(self) -> "Heartbeat":
        self._register()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(beat_every(self.ttl_s)):
            try:
                if self._lease.refresh() <= 0:  # expired (etcd was away too long): take a new one
                    self._register()
            except Exception as exc:  # the waiting stage reports the consequence
                log.warning("heartbeat of rank %d failed: %r", self.rank, exc)

    def stop(self) -> None:
        self._stop.set()


def alive_ranks(meta: MetadataStore) -> set[int]:
    prefix = meta.key("alive") + "/"
    return {int(k[len(prefix) :]) for k, _ in meta.get_prefix(prefix)}


class PeerWatch:
    """Bounds every blocking wait of this process by its peers' liveness, including the ones
    nothing else can interrupt (a collective with a dead peer, a barrier of a checkpoint write).

    Invariant: once armed (every rank and warehouse of the world has registered), a rank or
    warehouse key that stays missing for ``grace_s`` while the watch is healthy calls
    ``on_lost(reason)`` once; the trainer exits the process there, so torchrun restarts the
    group about ``heartbeat_ttl_s + grace_s`` after a peer dies. A key that comes back within
    ``grace_s`` (a lease that lapsed on an overloaded etcd and was taken again) is no loss. An
    unreachable etcd (a broken watch) proves nothing and resets the evidence (the ranks ride
    out an etcd restart). ``lost_ranks`` gives the dock's waits the same view.

    The keys are read once and then followed through two etcd watches (the rank keys and the
    warehouse keys; an expired lease is a DELETE event), so a healthy world costs etcd no
    reads: polling both prefixes every second cost each rank two range reads of O(world) keys
    per second, O(world^2) bytes per second in all (``tools/bench_control_plane.py``). The
    thread re-checks its view every ``poll_s`` and re-reads etcd only after a broken watch."""

    KINDS = ("alive", "warehouse_alive")

    def __init__(
        self,
        meta: MetadataStore,
        world: int,
        warehouses: Sequence[int],
        on_lost: Callable[[str], None],
        poll_s: float = 1.0,
        grace_s: float = 2.0,
    ):
        self.meta = meta
        self.world = world
        self.warehouses = list(warehouses)
        self.on_lost = on_lost
        self.poll_s = poll_s
        self.grace_s = grace_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)
        self._lock = threading.Lock()
        self._members = {"alive": set(range(world)), "warehouse_alive": set(self.warehouses)}
        self._gone: dict[tuple[str, int], float] = {}
        """(kind, who) -> since when the key has been missing, while the watch is healthy."""
        self._watches: list[tuple[threading.Thread, Callable[[], None]]] = []

    def _lost(self, kind: str) -> list[int]:
        now = time.monotonic()
        with self._lock:
            return sorted(w for (k, w), since in self._gone.items() if k == kind and now - since >= self.grace_s)

    def lost_ranks(self) -> set[int]:
        """Ranks of the world whose key has been gone for ``grace_s``."""
        return set(self._lost("alive"))

    def lost_warehouses(self) -> set[int]:
        """Nodes whose warehouse key has been gone for ``grace_s``."""
        return set(self._lost("warehouse_alive"))

    def missing(self) -> list[str]:
        """What has been gone for ``grace_s``: ``rank r`` / ``warehouse of node n``."""
        return [f"rank {r}" for r in self._lost("alive")] + [
            f"warehouse of node {n}" for n in self._lost("warehouse_alive")
        ]

    def start(self) -> "PeerWatch":
        """Read the keys and start watching now (so the view exists when this returns); an
        etcd away at this moment leaves that to the thread."""
        try:
            self._resync()
        except Exception as exc:
            log.warning("peer watch cannot read liveness keys yet: %s", exc)
        self._thread.start()
        return self

    def _watching(self) -> bool:
        return bool(self._watches) and all(t.is_alive() for t, _ in self._watches)

    def _resync(self) -> None:
        """Read both prefixes, then watch each from its read's revision + 1 (no gap); the
        evidence starts afresh."""
        self._cancel_watches()
        with self._lock:
            self._gone.clear()
        for kind in self.KINDS:
            prefix = self.meta.key(kind) + "/"
            revision, kvs = self.meta.get_prefix_at(prefix)
            present = {int(k[len(prefix) :]) for k, _, _ in kvs}
            now = time.monotonic()
            with self._lock:
                self._gone.update({(kind, w): now for w in self._members[kind] - present})
            events, cancel = self.meta.watch_prefix(prefix, start_revision=revision + 1)
            pump = threading.Thread(target=self._pump, args=(kind, prefix, events), name="peer-watch-feed", daemon=True)
            pump.start()
            self._watches.append((pump, cancel))

    def _pump(self, kind: str, prefix: str, events) -> None:
        try:
            for ev in events:
                who = int(ev["kv"]["key"].decode()[len(prefix) :])
                with self._lock:
                    if ev.get("type", "PUT") == "PUT":
                        self._gone.pop((kind, who), None)
                    elif who in self._members[kind]:
                        self._gone.setdefault((kind, who), time.monotonic())
        except Exception as exc:  # etcd away: the run loop re-reads once it is back
            log.debug("liveness watch of %s ended: %s", prefix, exc)

    def _cancel_watches(self) -> None:
        for _, cancel in self._watches:
            try:
                cancel()
            except Exception:  # noqa: S110 - a watch whose etcd is gone has nothing left to cancel
                pass
        self._watches.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if not self._watching():
                try:  # a broken watch is no evidence either way: read again, evidence afresh
                    self._resync()
                except Exception as exc:
                    log.warning("peer watch cannot read liveness keys: %s", exc)
                    with self._lock:
                        self._gone.clear()
                    continue
            gone = self.missing()
            if gone and not self._stop.is_set():
                self.on_lost(f"{', '.join(gone)} lost (liveness key expired or withdrawn)")
                break
        self._cancel_watches()

    def stop(self) -> None:
        self._stop.set()
        self._cancel_watches()
