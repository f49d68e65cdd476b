"""Streaming gets: a stage consumes its inputs in waves as samples become ready, instead of
waiting for the whole iteration (AsyncFlow's streamed data module, arXiv 2507.01663 §3).

Arrival order is etcd's own: every put-record has a create revision. A unit (a sample, or a
whole prompt group for a group-granular stage) is *ready* at the largest revision among the
records that carry its inputs; ready units are ordered by (ready revision, unit key). Wave k
is units [kW, (k+1)W) of that order, with W = DP groups x ``units_per_group``; the last wave
may be shorter. Revisions only grow, so once (k+1)W units are ready the first (k+1)W of the
order can no longer change. Every controller of the stage, whenever it reads etcd, therefore
cuts the same waves and splits each with the same ``assign``: the split is deterministic given
the recorded arrival order, with no arbiter. Over its waves the stream delivers every expected
index exactly once (tested).

New records are noticed through the iteration's record feed (``dock.feed``: an etcd watch on
the put-records, started at the revision of the first read); there is no polling loop. Without any event
for ``_IDLE_S`` the stream checks the ranks' liveness, re-reads etcd if the watch broke, and
gives up at the dock's ``get_timeout_s`` naming what is missing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from spmd_rl.config.layout import Layout
from spmd_rl.dock.controller import describe_missing, fail_if_ranks_lost, group_nodes, split
from spmd_rl.dock.errors import DockTimeout
from spmd_rl.dock.feed import RecordView
from spmd_rl.dock.records import PutRecord

if TYPE_CHECKING:
    from spmd_rl.dock.batch import DockBatch
    from spmd_rl.dock.fetch import Fetcher

log = logging.getLogger(__name__)
_IDLE_S = 1.0


def ready_order(
    records: Sequence[tuple[int, PutRecord]], columns: Sequence[str], expected: Sequence[int], group_size: int = 1
) -> list[tuple[int, int]]:
    """(ready revision, unit key) of every unit whose expected indices all have every column,
    sorted. A unit's key is index // group_size."""
    rev: dict[str, dict[int, int]] = {c: {} for c in columns}
    for r, rec in records:
        for c in rec.columns:
            if c in rev:
                rev[c].update(dict.fromkeys(rec.indices, r))
    members: dict[int, list[int]] = {}
    for i in expected:
        members.setdefault(i // group_size, []).append(i)
    out = []
    for key, idx in members.items():
        revs = [rev[c].get(i) for c in columns for i in idx]
        if None not in revs:
            out.append((max(revs, default=0), key))
    return sorted(out)


class StageStream:
    """This rank's DP group's share of each wave of a stage's ready inputs (module docstring).
    ``poll`` never blocks; ``next`` and iteration wait for the next wave."""

    def __init__(  # noqa: PLR0913
        self,
        dock: "Fetcher",
        feed: RecordView,
        stage: str,
        iteration: int,
        columns: Sequence[str],
        layout: Layout,
        expected: Sequence[int],
        group_size: int = 1,
        units_per_group: int = 1,
        timeout_s: float | None = None,
    ):
        self.dock, self.stage, self.iteration = dock, stage, iteration
        self.columns, self.expected, self.group_size = list(columns), list(expected), group_size
        self.dp_index = layout.coords(dock.peer.rank)[0]
        self.group_nodes = group_nodes(layout, dock.peer.nproc_per_node)
        self.total = len({i // group_size for i in self.expected})
        self.wave = max(1, layout.dp * units_per_group)
        self.timeout_s = timeout_s or dock.cfg.get_timeout_s
        self.order: list[int] = []
        """Unit keys in the order the waves delivered them (the same on every rank)."""
        self.feed = feed
        self._seen = -1

    @property
    def done(self) -> bool:
        return len(self.order) >= self.total

    def poll(self) -> "DockBatch | None":
        """The next wave's share if that wave is complete now, else None."""
        if self.done or self.feed.version == self._seen:
            return None
        self._seen, records = self.feed.snapshot()
        ready = ready_order(records, self.columns, self.expected, self.group_size)
        need = min(len(self.order) + self.wave, self.total)
        if len(ready) < need:
            return None
        keys = [k for _, k in ready[len(self.order) : need]]
        self.order += keys
        self._seen = -1  # the records may already complete the wave after this one
        loc = self.feed.locations()
        members = set(keys)
        wave = [i for i in self.expected if i // self.group_size in members]
        mine = split(loc, self.columns, wave, self.group_nodes, self.group_size)[self.dp_index]
        return self.dock.plain_batch(
            self.iteration, mine, self.columns, loc
        )  # no TP relay: a poll never waits on a peer

    def next(self) -> "DockBatch | None":
        """Block until the next wave (None once every wave was delivered)."""
        deadline = time.monotonic() + self.timeout_s
        while not self.done:
            batch = self.poll()
            if batch is not None:
                return batch
            if self.feed.wait_change(self._seen, _IDLE_S):
                continue
            self._check_peers()
            if not self.feed.watching:
                self.feed.resync()
            if time.monotonic() > deadline:
                self._timeout()
        return None

    def __iter__(self) -> Iterator["DockBatch"]:
        while (batch := self.next()) is not None:
            yield batch

    def _check_peers(self) -> None:
        if self.dock.heartbeat is not None:
            fail_if_ranks_lost(self.dock.lost_ranks, f"stage {self.stage}", f"streaming iteration {self.iteration}")

    def _timeout(self) -> None:
        missing = self.feed.missing(self.columns, self.expected)
        raise DockTimeout(
            f"stage {self.stage} streamed {len(self.order)} of {self.total} units of iteration {self.iteration} and "
            f"waited {self.timeout_s:.1f}s for the next wave; " + describe_missing(self.dock.specs, missing)
        )
