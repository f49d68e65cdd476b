"""A stage's controller: from the iteration's put-records (this rank's record feed,
``dock.feed``), wait until every expected index has all the stage's input columns, then split
them over the stage's DP groups with :func:`assign`.

Every rank of a stage embeds one and they all see the same records, so they agree without an
arbiter. Group-granular stages (advantages over the N responses of a prompt) assign whole
prompt groups: unit key = index // group_size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spmd_rl.config.layout import Layout
from spmd_rl.dock.assign import Unit, assign
from spmd_rl.dock.columns import ColumnSpec
from spmd_rl.dock.errors import DockTimeout, DockUnavailable
from spmd_rl.dock.feed import RecordView
from spmd_rl.dock.records import Locations, describe


@dataclass
class Assignment:
    groups: list[list[int]]
    locations: Locations


def describe_missing(specs: dict[str, ColumnSpec], missing: dict[str, list[int]]) -> str:
    """What a stage still waits for: each column, the stage that writes it, the missing indices."""
    return "; ".join(
        f"column {c!r} (written by stage {specs[c].writer}): missing {describe(m)}" for c, m in missing.items()
    )


_IDLE_S = 1.0
"""A wait without a new record for this long checks the peers' liveness and the watch."""

LostRanks = Callable[[], set[int]]
"""The ranks of the world whose liveness key is gone (``Fetcher.lost_ranks``)."""


def fail_if_ranks_lost(lost_ranks: LostRanks, who: str, doing: str) -> None:
    """DockUnavailable once any rank of the world has lost its heartbeat key."""
    lost = lost_ranks()
    if lost:
        raise DockUnavailable(
            f"{who}: rank(s) {sorted(lost)} lost (heartbeat expired) while {doing}; "
            "exiting so torchrun can restart the group"
        )


def group_nodes(layout: Layout, nproc_per_node: int) -> list[int]:
    """The node of each DP group of ``layout`` (its leader's)."""
    return [layout.dp_group_leader(g) // nproc_per_node for g in range(layout.dp)]


def units_for(loc: Locations, columns: Sequence[str], expected: Sequence[int], group_size: int) -> list[Unit]:
    """One unit per index (or per prompt group). Tokens: summed lengths of the ragged inputs
    (1 when the stage reads only scalars). Node: where the first ragged input (else the first
    input) of the unit's first index lives."""
    ragged = [c for c in columns if c in loc.length]
    home = ragged[0] if ragged else columns[0]
    units: dict[int, list[int]] = {}
    for i in expected:
        key = i // group_size
        tok = sum(loc.length[c][i] for c in ragged) if ragged else 1
        if key in units:
            units[key][0] += tok
        else:
            units[key] = [tok, loc.node[home][i]]
    return [Unit(k, t, n) for k, (t, n) in units.items()]


class StageController:
    def __init__(
        self,
        feed: RecordView,
        stage: str,
        specs: dict[str, ColumnSpec],
        settle_s: float = 0.02,
        lost_ranks: LostRanks | None = None,
    ):
        self.feed = feed
        self.stage = stage
        self.specs = specs
        self.settle_s = settle_s
        """After a new record, how long to let a burst of them arrive before looking again."""
        self.lost_ranks = lost_ranks
        """When set, waiting fails fast once a rank's heartbeat key is gone."""

    def wait(self, iteration: int, columns: Sequence[str], expected: Sequence[int], timeout_s: float) -> Locations:
        """Block until all ``columns`` exist for all ``expected`` indices; DockTimeout names the
        missing indices and the stage that should have written them."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = self.feed.version
            if self.feed.ready(columns, expected):
                return self.feed.locations()
            left = deadline - time.monotonic()
            if left <= 0:
                raise DockTimeout(
                    f"stage {self.stage} waited {timeout_s:.1f}s for iteration {iteration}; "
                    + describe_missing(self.specs, self.feed.missing(columns, expected))
                )
            if self.feed.wait_change(seen, min(_IDLE_S, left)):
                time.sleep(self.settle_s)
                continue
            if self.lost_ranks is not None:
                fail_if_ranks_lost(self.lost_ranks, f"stage {self.stage}", f"waiting for iteration {iteration}")
            if not self.feed.watching:
                self.feed.resync()

    def plan(
        self,
        iteration: int,
        columns: Sequence[str],
        expected: Sequence[int],
        group_nodes: Sequence[int],
        group_size: int = 1,
        timeout_s: float = 600.0,
        parts: int = 1,
    ) -> Assignment:
        loc = self.wait(iteration, columns, expected, timeout_s)
        return Assignment(split(loc, columns, expected, group_nodes, group_size, parts), loc)


def split(
    loc: Locations,
    columns: Sequence[str],
    expected: Sequence[int],
    group_nodes: Sequence[int],
    group_size: int = 1,
    parts: int = 1,
) -> list[list[int]]:
    """Indices per DP group: ``assign`` of the units (samples, or whole prompt groups) of
    ``expected``, expanded back to the expected indices of each unit.

    With ``parts`` > 1, ``expected`` is ``parts`` consecutive equal runs (a stage's mini-batches,
    ``Stage.mini_batched``) and each run is assigned on its own: a group's indices are its share
    of run 0, then of run 1, ... So which indices form part p is fixed by ``expected`` alone,
    whatever the number of DP groups; one assignment of the whole would put a layout-dependent
    set of indices first on each group."""
    if parts > 1:
        if len(expected) % parts:
            raise ValueError(f"{len(expected)} expected indices do not split into {parts} equal parts")
        size = len(expected) // parts
        runs = [split(loc, columns, expected[p * size : (p + 1) * size], group_nodes, group_size) for p in range(parts)]
        return [[i for run in runs for i in run[g]] for g in range(len(group_nodes))]
    groups = assign(units_for(loc, columns, expected, group_size), group_nodes)
    if group_size > 1:
        wanted = set(expected)
        groups = [
            [i for k in keys for i in range(k * group_size, (k + 1) * group_size) if i in wanted] for keys in groups
        ]
    return groups
