"""Rank liveness in etcd: each rank holds ``/<job>/alive/<rank>`` under a lease it refreshes
from a background thread. When a rank dies its key expires after ``ttl_s``; a stage waiting
in the dock for that rank's data then fails with DockUnavailable naming the lost ranks, so
the process exits non-zero and torchrun restarts the group instead of waiting forever."""

from __future__ import annotations

import logging
import threading

from spmd_rl.dock.metadata import MetadataStore

log = logging.getLogger(__name__)


class Heartbeat:
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
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self._lease.refresh() <= 0:  # expired (etcd was away too long): take a new one
                    self._register()
            except Exception as exc:  # the waiting stage reports the consequence
                log.warning("heartbeat of rank %d failed: %s", self.rank, exc)

    def stop(self) -> None:
        self._stop.set()


def alive_ranks(meta: MetadataStore) -> set[int]:
    prefix = meta.key("alive") + "/"
    return {int(k[len(prefix):]) for k, _ in meta.get_prefix(prefix)}
