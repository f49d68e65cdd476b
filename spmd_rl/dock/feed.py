"""The put-records of one iteration as this rank sees them (``RecordView``), kept current
either by an etcd watch (``RecordFeed``: read once, then watched from the revision of that
read, no gap and no overlap) or by the node's warehouse (``dock.node_feed``), which follows
one ``RecordFeed`` for all the ranks of its node.

Every blocking get (``dock.controller``), every streamed wave (``dock.stream``) and every put's
duplicate check of the iteration reads this one copy instead of etcd. Reading the iteration's
records on every get poll and every put cost each rank O(records) bytes per call, O(world^2)
per stage in all (``tools/bench_control_plane.py``); a watch per rank delivers each record to
each rank once (R records x R ranks events per stage), a watch per node once per node (R x S).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence

from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.dock.errors import DockRequestError
from spmd_rl.dock.records import Locations, PutRecord

log = logging.getLogger(__name__)


class RecordView:
    """Every put-record of one iteration seen so far, in arrival order, with its create
    revision, and where each (column, index) lives (``Locations``, grown record by record, so
    a waiting stage never rebuilds it). ``version`` counts the changes seen; ``count`` the
    records. Subclasses deliver records through ``_add``."""

    def __init__(self) -> None:
        self.version = 0
        self._cond = threading.Condition()
        self._keys: set[str] = set()
        self._arrived: list[tuple[str, int, PutRecord]] = []
        """(key, create revision, record) in arrival order."""
        self._listeners: list[Callable[[], None]] = []
        self._loc = Locations()
        self._error: DockRequestError | None = None
        """A record that wrote a (column, index) twice: every later read raises it."""

    def _add(self, key: str, revision: int, record: PutRecord) -> None:
        """Under the lock: a record seen for the first time (arrival order is kept: a key seen
        again is ignored, so ``since(n)`` of an earlier count stays valid)."""
        if key in self._keys:
            return
        self._keys.add(key)
        self._arrived.append((key, revision, record))
        try:
            self._loc.add(record)
        except DockRequestError as exc:
            self._error = self._error or exc
        self.version += 1
        self._cond.notify_all()
        for listener in self._listeners:
            listener()

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (under the view's lock: it must not block) on every new record."""
        with self._cond:
            self._listeners.append(listener)

    @property
    def count(self) -> int:
        return len(self._arrived)

    def since(self, n: int) -> list[tuple[str, int, PutRecord]]:
        """(key, create revision, record) of every record after the first ``n``, in arrival order."""
        with self._cond:
            return self._arrived[n:]

    def snapshot(self) -> tuple[int, list[tuple[int, PutRecord]]]:
        """(version, every record with its create revision)."""
        with self._cond:
            self._raise()
            return self.version, [(rev, rec) for _, rev, rec in self._arrived]

    def locations(self) -> Locations:
        """A copy of where every (column, index) seen so far lives."""
        with self._cond:
            self._raise()
            return self._loc.copy()

    def ready(self, columns: Sequence[str], expected: Sequence[int]) -> bool:
        """Whether every ``expected`` index has every column. A column with fewer indices than
        ``expected`` answers without a look at each, so a waiting stage's check costs
        O(columns) until the last records arrive."""
        with self._cond:
            self._raise()
            if any(self._loc.count(c) < len(expected) for c in columns):
                return False
            return not any(self._loc.missing(c, list(expected)) for c in columns)

    def missing(self, columns: Sequence[str], expected: Sequence[int]) -> dict[str, list[int]]:
        """Per column, the ``expected`` indices not seen yet."""
        with self._cond:
            return {c: miss for c in columns if (miss := self._loc.missing(c, list(expected)))}

    def written(self, column: str, index: int) -> str | None:
        """The writer of (``column``, ``index``) seen so far, or None."""
        with self._cond:
            return self._loc.writer.get(column, {}).get(index)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def wait_change(self, seen: int, timeout_s: float) -> bool:
        """Block until ``version`` differs from ``seen``; False after ``timeout_s`` without."""
        with self._cond:
            return self._cond.wait_for(lambda: self.version != seen, timeout_s)

    @property
    def watching(self) -> bool:
        """Whether new records still arrive; when False, ``resync`` follows the source again."""
        raise NotImplementedError

    def resync(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class RecordFeed(RecordView):
    """The records of one iteration read from etcd, then followed by a puts-only etcd watch."""

    def __init__(self, meta: MetadataStore, iteration: int):
        super().__init__()
        self.meta = meta
        self.prefix = meta.key(iteration, "puts") + "/"
        self._cancel = None
        self._thread: threading.Thread | None = None
        self._resyncing = threading.Lock()
        self.resync()

    def resync(self) -> None:
        """Unless the watch is alive: read every record, then watch from the read's revision + 1.
        Callers racing here (a node's waiting ranks and its warehouse) resync once."""
        with self._resyncing:
            if self.watching:
                return
            self._stop_watch()
            revision, kvs = self.meta.get_prefix_at(self.prefix)
            with self._cond:
                for key, raw, rev in kvs:
                    self._add(key, rev, PutRecord.decode(raw))
                self.version += 1
                self._cond.notify_all()
            # the iteration's commit deletes every record: etcd would send each watcher one event per record
            events, self._cancel = self.meta.watch_prefix(self.prefix, start_revision=revision + 1, puts_only=True)
            self._thread = threading.Thread(target=self._pump, args=(events,), name="dock-feed", daemon=True)
            self._thread.start()

    def _pump(self, events: Iterator[dict]) -> None:
        try:
            for ev in events:
                kv = ev["kv"]
                record = PutRecord.decode(kv["value"])
                with self._cond:
                    self._add(kv["key"].decode(), int(kv["create_revision"]), record)
        except Exception as exc:  # a broken watch: the next idle wait (or the warehouse) resyncs
            log.debug("put-record watch of %s ended: %s", self.prefix, exc)

    @property
    def watching(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Cancel the watch and wait (up to 5 s) for its thread to end."""
        with self._resyncing:
            self._stop_watch()

    def _stop_watch(self) -> None:
        if self._cancel is not None:
            self._cancel()
            self._cancel = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
