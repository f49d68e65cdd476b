"""Liveness in etcd: each rank holds ``/<job>/alive/<rank>`` and each warehouse
``/<job>/warehouse_alive/<node>`` under a lease refreshed from a background thread. When the
owner dies the key expires after ``ttl_s``; when a warehouse's server thread stops (its rank
still alive) the heartbeat sees it unhealthy and deletes the key at once. A stage waiting on
metadata or fetching from a warehouse then fails with DockUnavailable naming what was lost,
so the process exits non-zero and torchrun restarts the group instead of waiting forever."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from spmd_rl.dock.metadata import MetadataStore

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, meta: MetadataStore, rank: int, ttl_s: int = 10, kind: str = "alive",
                 healthy: Callable[[], bool] | None = None):
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
    return {int(k[len(prefix):]) for k, _ in meta.get_prefix(prefix)}
