"""Put-records: the metadata a writer publishes in etcd for each put, batched per put.

One record = (stage, rank, node, columns, indices as ranges, per-sample lengths of ragged
columns), JSON-encoded under ``/<job>/<iteration>/puts/<rank>-<seq>``. From all records of an
iteration a controller derives where each (column, index) lives and how long it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from spmd_rl.dock.errors import DockRequestError


def to_ranges(indices: list[int]) -> list[list[int]]:
    """Sorted distinct ints -> half-open runs [[start, stop), ...]."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def from_ranges(runs: list[list[int]]) -> list[int]:
    return [i for a, b in runs for i in range(a, b)]


def describe(indices: list[int], limit: int = 6) -> str:
    """Compact text of an index set, e.g. '0-15, 32-47 (32 indices)'."""
    runs = to_ranges(indices)
    parts = [f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in runs[:limit]]
    more = ", ..." if len(runs) > limit else ""
    return f"{', '.join(parts)}{more} ({len(indices)} indices)"


@dataclass
class PutRecord:
    stage: str
    rank: int
    node: int
    columns: list[str]
    indices: list[int]
    lengths: dict[str, list[int]] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "stage": self.stage,
                "rank": self.rank,
                "node": self.node,
                "columns": self.columns,
                "ranges": to_ranges(self.indices),
                "order": self.indices if self.indices != sorted(self.indices) else None,
                "lengths": self.lengths,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "PutRecord":
        d = json.loads(raw)
        indices = d["order"] if d.get("order") is not None else from_ranges(d["ranges"])
        return cls(d["stage"], d["rank"], d["node"], d["columns"], indices, d.get("lengths", {}))


@dataclass
class Locations:
    """Where every written (column, index) lives and its length (ragged columns); ``writer``
    names the stage and rank that wrote it."""

    node: dict[str, dict[int, int]] = field(default_factory=dict)
    length: dict[str, dict[int, int]] = field(default_factory=dict)
    writer: dict[str, dict[int, str]] = field(default_factory=dict)

    @classmethod
    def from_records(cls, records: list[PutRecord]) -> "Locations":
        loc = cls()
        for r in records:
            loc.add(r)
        return loc

    def add(self, r: PutRecord) -> None:
        """Record ``r``'s (column, index) places; DockRequestError (and nothing added) when one
        of them was already written."""
        for c in r.columns:
            nodes = self.node.get(c, {})
            if not nodes.keys().isdisjoint(r.indices):
                i = next(i for i in r.indices if i in nodes)
                raise DockRequestError(
                    f"column {c!r} index {i} written twice: by stage {self.writer[c][i]} and by stage {r.stage} (rank "
                    f"{r.rank}); each column of a sample is written once per iteration"
                )
        label = f"{r.stage} (rank {r.rank})"
        for c in r.columns:
            self.node.setdefault(c, {}).update(dict.fromkeys(r.indices, r.node))
            self.writer.setdefault(c, {}).update(dict.fromkeys(r.indices, label))
            if c in r.lengths:
                self.length.setdefault(c, {}).update(zip(r.indices, r.lengths[c]))

    def copy(self) -> "Locations":
        return Locations(
            {c: dict(v) for c, v in self.node.items()},
            {c: dict(v) for c, v in self.length.items()},
            {c: dict(v) for c, v in self.writer.items()},
        )

    def count(self, column: str) -> int:
        """How many indices have ``column``."""
        return len(self.node.get(column, {}))

    def has(self, column: str, index: int) -> bool:
        return index in self.node.get(column, {})

    def missing(self, column: str, indices: list[int]) -> list[int]:
        """The ``indices`` not written for ``column``, in their order."""
        nodes = self.node.get(column, {})
        return [] if nodes.keys() >= set(indices) else [i for i in indices if i not in nodes]
