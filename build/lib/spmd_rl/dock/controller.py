"""A stage's controller: from the put-records in etcd, wait until every expected index has all
the stage's input columns, then split them over the stage's DP groups with :func:`assign`.

Every DP-group leader of a stage embeds one and they all read the same records, so they agree
without an arbiter. Group-granular stages (advantages over the N responses of a prompt) assign
whole prompt groups: unit key = index // group_size.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from spmd_rl.config.layout import Layout
from spmd_rl.dock.assign import Unit, assign
from spmd_rl.dock.columns import ColumnSpec
from spmd_rl.dock.errors import DockTimeout, DockUnavailable
from spmd_rl.dock.heartbeat import alive_ranks
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.dock.records import Locations, PutRecord, describe


@dataclass
class Assignment:
    groups: list[list[int]]
    locations: Locations


def read_records(meta: MetadataStore, iteration: int) -> list[PutRecord]:
    return [PutRecord.decode(v) for _, v in meta.get_prefix(meta.key(iteration, "puts") + "/")]


def missing_inputs(loc: Locations, columns: Sequence[str], expected: Sequence[int]) -> dict[str, list[int]]:
    want = list(expected)
    return {c: miss for c in columns if (miss := loc.missing(c, want))}


def describe_missing(specs: dict[str, ColumnSpec], missing: dict[str, list[int]]) -> str:
    """What a stage still waits for: each column, the stage that writes it, the missing indices."""
    return "; ".join(
        f"column {c!r} (written by stage {specs[c].writer}): missing {describe(m)}" for c, m in missing.items()
    )


def fail_if_ranks_lost(meta: MetadataStore, world: int, who: str, doing: str) -> None:
    """DockUnavailable once any rank of the world has lost its heartbeat key."""
    lost = set(range(world)) - alive_ranks(meta)
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
        meta: MetadataStore,
        stage: str,
        specs: dict[str, ColumnSpec],
        poll_s: float = 0.02,
        world: int | None = None,
    ):
        self.meta = meta
        self.stage = stage
        self.specs = specs
        self.poll_s = poll_s
        self.world = world
        """When set, waiting fails fast once a rank's heartbeat key is gone."""

    def wait(self, iteration: int, columns: Sequence[str], expected: Sequence[int], timeout_s: float) -> Locations:
        """Block until all ``columns`` exist for all ``expected`` indices; DockTimeout names the
        missing indices and the stage that should have written them."""
        deadline = time.monotonic() + timeout_s
        delay = self.poll_s
        while True:
            loc = Locations.from_records(read_records(self.meta, iteration))
            missing = missing_inputs(loc, columns, expected)
            if not missing:
                return loc
            if self.world is not None and delay >= 0.25:
                fail_if_ranks_lost(self.meta, self.world, f"stage {self.stage}", f"waiting for iteration {iteration}")
            if time.monotonic() >= deadline:
                raise DockTimeout(
                    f"stage {self.stage} waited {timeout_s:.1f}s for iteration {iteration}; "
                    + describe_missing(self.specs, missing)
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def plan(
        self,
        iteration: int,
        columns: Sequence[str],
        expected: Sequence[int],
        group_nodes: Sequence[int],
        group_size: int = 1,
        timeout_s: float = 600.0,
    ) -> Assignment:
        loc = self.wait(iteration, columns, expected, timeout_s)
        return Assignment(split(loc, columns, expected, group_nodes, group_size), loc)


def split(
    loc: Locations, columns: Sequence[str], expected: Sequence[int], group_nodes: Sequence[int], group_size: int = 1
) -> list[list[int]]:
    """Indices per DP group: ``assign`` of the units (samples, or whole prompt groups) of
    ``expected``, expanded back to the expected indices of each unit."""
    groups = assign(units_for(loc, columns, expected, group_size), group_nodes)
    if group_size > 1:
        wanted = set(expected)
        groups = [
            [i for k in keys for i in range(k * group_size, (k + 1) * group_size) if i in wanted] for keys in groups
        ]
    return groups
