"""Liveness in etcd: each rank holds ``/<job>/alive/<rank>`` and each warehouse
``/<job>/warehouse_alive/<node>`` under a lease refreshed from a background thread. When the
owner dies the key expires after ``ttl_s``; when a warehouse's server thread stops (its rank
still alive) the heartbeat sees it unhealthy and deletes the key at once. A stage waiting on
metadata or fetching from a warehouse then fails with DockUnavailable naming what was lost,
so the process exits non-zero and torchrun restarts the group instead of waiting forever.
:class:`PeerWatch` extends that bound to waits nothing else can interrupt (a collective)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from spmd_rl.dock.metadata import MetadataStore

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        meta: MetadataStore,
        rank: int,
        ttl_s: int = 10,
        kind: str = "alive",
        healthy: Callable[[], bool] | None = None,
    ):
        """Holds ``/<job>/<kind>/<rank>``; with ``healthy``, the key is deleted as soon as it
        returns False (and not renewed)."""
        self.meta = meta
        self.rank = rank
        self.ttl_s = ttl_s
        self.kind = kind
        self.healthy = healthy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._lease = None

    def _register(self) -> None:
        self._lease = self.meta.lease(self.ttl_s)
        self.meta.put(self.meta.key(self.kind, self.rank), b"1", lease=self._lease)

    def start(self) -> "Heartbeat":
        self._register()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.ttl_s / 3)):
            try:
                if self.healthy is not None and not self.healthy():
                    log.warning("%s %d is unhealthy: withdrawing its liveness key", self.kind, self.rank)
                    self.meta.delete(self.meta.key(self.kind, self.rank))
                    return
                if self._lease.refresh() <= 0:  # expired (etcd was away too long): take a new one
                    self._register()
            except Exception as exc:  # the waiting stage reports the consequence
                log.warning("heartbeat of rank %d failed: %s", self.rank, exc)

    def stop(self) -> None:
        self._stop.set()


def alive_ranks(meta: MetadataStore) -> set[int]:
    prefix = meta.key("alive") + "/"
    return {int(k[len(prefix) :]) for k, _ in meta.get_prefix(prefix)}


class PeerWatch:
    """Bounds every blocking wait of this process by its peers' liveness, including the ones
    nothing else can interrupt (a collective with a dead peer, a barrier of a checkpoint write).

    Invariant: once armed (every rank and warehouse of the world has registered), a rank or
    warehouse key that is missing on consecutive successful polls spanning ``grace_s`` calls
    ``on_lost(reason)`` once; the trainer exits the process there, so torchrun restarts the
    group about ``heartbeat_ttl_s + grace_s`` after a peer dies. An unreachable etcd proves
    nothing and resets the evidence (the ranks ride out an etcd restart)."""

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

    def missing(self) -> list[str]:
        """What is gone now: ``rank r`` / ``warehouse of node n``."""
        ranks = set(range(self.world)) - alive_ranks(self.meta)
        prefix = self.meta.key("warehouse_alive") + "/"
        served = {int(k[len(prefix) :]) for k, _ in self.meta.get_prefix(prefix)}
        return [f"rank {r}" for r in sorted(ranks)] + [
            f"warehouse of node {n}" for n in self.warehouses if n not in served
        ]

    def start(self) -> "PeerWatch":
        self._thread.start()
        return self

    def _run(self) -> None:
        since: float | None = None
        while not self._stop.wait(self.poll_s):
            try:
                gone = self.missing()
            except Exception as exc:  # etcd away: no evidence either way
                log.warning("peer watch cannot read liveness keys: %s", exc)
                since = None
                continue
            if not gone:
                since = None
            elif since is None:
                since = time.monotonic()
            elif time.monotonic() - since >= self.grace_s and not self._stop.is_set():
                self.on_lost(f"{', '.join(gone)} lost (liveness key expired or withdrawn)")
                return

    def stop(self) -> None:
        self._stop.set()
