"""The controllers' assignment of ready units (samples, or whole prompt groups) to DP groups.

A pure, deterministic function of its inputs, so every controller computes the same split with
no arbiter. Guarantees, with L the token count of the largest unit:

- every unit goes to exactly one group; group sizes differ by at most one unit;
- token balance: max group load - min group load <= L;
- locality: units go to a group on their own node whenever that keeps the balance bound.

Units are dealt in rounds of D (= number of groups), one per group. A round visits the groups
from least to most loaded and gives each the largest remaining unit of its own node (else the
largest remaining unit). If that round would break the bound, its units are re-paired sorted:
largest unit to least-loaded group. Sorted pairing keeps the bound whatever units the round
holds: for loads l_i <= l_j and units x_i >= x_j, (l_i + x_i) - (l_j + x_j) <= x_i <= L and
(l_j + x_j) - (l_i + x_i) <= l_j - l_i <= L. A last, partial round goes sorted to the
least-loaded groups (same argument; groups left out keep loads >= the ones that receive).
Units that are all of one size take a direct quota split with the same guarantees
(``_assign_equal``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    key: int
    tokens: int
    node: int


class _Pool:
    """Remaining units, largest first, overall and per node."""

    def __init__(self, units: Sequence[Unit]):
        self.order = sorted(units, key=lambda u: (-u.tokens, u.key))
        self.by_node: dict[int, list[Unit]] = {}
        for u in self.order:
            self.by_node.setdefault(u.node, []).append(u)
        self.taken: set[int] = set()
        self._head = 0
        self._node_head: dict[int, int] = dict.fromkeys(self.by_node, 0)

    def __len__(self) -> int:
        return len(self.order) - len(self.taken)

    def _first(self, seq: list[Unit], start: int) -> int:
        while start < len(seq) and seq[start].key in self.taken:
            start += 1
        return start

    def take_largest(self, node: int | None = None) -> Unit:
        """The largest remaining unit on ``node`` if it has one, else the largest overall."""
        if node in self.by_node:
            seq = self.by_node[node]
            self._node_head[node] = i = self._first(seq, self._node_head[node])
            if i < len(seq):
                self.taken.add(seq[i].key)
                return seq[i]
        self._head = i = self._first(self.order, self._head)
        self.taken.add(self.order[i].key)
        return self.order[i]


def assign(units: Sequence[Unit], group_nodes: Sequence[int]) -> list[list[int]]:
    """Keys per group, each list sorted. ``group_nodes[g]`` is the node of DP group g."""
    d = len(group_nodes)
    if d == 0:
        raise ValueError("no DP groups to assign to")
    if len({u.key for u in units}) != len(units):
        raise ValueError("unit keys must be unique")
    if units and len({u.tokens for u in units}) == 1:
        return _assign_equal(units, group_nodes)
    pool = _Pool(units)
    bound = pool.order[0].tokens if units else 0
    loads = [0] * d
    out: list[list[int]] = [[] for _ in range(d)]
    while len(pool):
        by_load = sorted(range(d), key=lambda g: (loads[g], g))
        if len(pool) >= d:
            pairs = [(g, pool.take_largest(group_nodes[g])) for g in by_load]
            trial = list(loads)
            for g, u in pairs:
                trial[g] += u.tokens
            if max(trial) - min(trial) > bound:
                chosen = sorted((u for _, u in pairs), key=lambda u: (-u.tokens, u.key))
                pairs = list(zip(by_load, chosen))
        else:
            pairs = list(zip(by_load, [pool.take_largest() for _ in range(len(pool))]))
        for g, u in pairs:
            loads[g] += u.tokens
            out[g].append(u.key)
    return [sorted(keys) for keys in out]


def _assign_equal(units: Sequence[Unit], group_nodes: Sequence[int]) -> list[list[int]]:
    """Units of one size (fixed-length or scalar-only stages): any split whose group sizes
    differ by at most one keeps the token bound, so the dealing above reduces to quotas. Group
    g gets n // d units, the first n % d groups one more; each group takes its node's units
    (by key) up to its quota, then the leftover units (by key) fill the remaining quotas. The
    local count is sum over nodes of min(units there, quota of the groups there): the most any
    split with these quotas can keep local."""
    d, n = len(group_nodes), len(units)
    quota = [n // d + (g < n % d) for g in range(d)]
    by_node: dict[int, list[int]] = {}
    for u in sorted(units, key=lambda u: u.key):
        by_node.setdefault(u.node, []).append(u.key)
    out: list[list[int]] = []
    for g, node in enumerate(group_nodes):
        mine = by_node.get(node, [])
        out.append(mine[: quota[g]])
        by_node[node] = mine[quota[g] :]
    rest = sorted(k for keys in by_node.values() for k in keys)
    for g in range(d):
        need = quota[g] - len(out[g])
        out[g] += rest[:need]
        rest = rest[need:]
    return [sorted(keys) for keys in out]
