"""The controllers' assignment of ready units (samples, or whole prompt groups) to DP groups.

A pure, deterministic function of its inputs, so every controller computes the same split with
no arbiter. Guarantees, with L the token count of the largest unit:

- every unit goes to exactly one group; group sizes differ by at most one unit;
- token balance: max group load - min group load <= L;
- locality: a unit goes to a group on its own node whenever that keeps the balance bound.

Units are taken in rounds of D (= number of groups) in order of decreasing tokens (ties by
key). In a round, each unit first tries the least-loaded unused group on its node; if the
round's result would break the bound, the round falls back to the sorted pairing (largest unit
to least-loaded group), which keeps the bound: for loads l_i <= l_j and units x_i >= x_j,
(l_i + x_i) - (l_j + x_j) <= x_i <= L and (l_j + x_j) - (l_i + x_i) <= l_j - l_i <= L.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    key: int
    tokens: int
    node: int


def _local_first(chunk: list[Unit], groups: list[int], group_nodes: Sequence[int]) -> list[int]:
    """For each unit of the round, the least-loaded remaining group on its node, else the
    least-loaded remaining group (``groups`` is sorted by load)."""
    free = list(groups)
    picks = []
    for u in chunk:
        g = next((g for g in free if group_nodes[g] == u.node), free[0])
        free.remove(g)
        picks.append(g)
    return picks


def assign(units: Sequence[Unit], group_nodes: Sequence[int]) -> list[list[int]]:
    """Keys per group, each list sorted. ``group_nodes[g]`` is the node of DP group g."""
    d = len(group_nodes)
    if d == 0:
        raise ValueError("no DP groups to assign to")
    if len({u.key for u in units}) != len(units):
        raise ValueError("unit keys must be unique")
    order = sorted(units, key=lambda u: (-u.tokens, u.key))
    bound = order[0].tokens if order else 0
    loads = [0] * d
    out: list[list[int]] = [[] for _ in range(d)]
    for start in range(0, len(order), d):
        chunk = order[start : start + d]
        by_load = sorted(range(d), key=lambda g: (loads[g], g))
        picks = _local_first(chunk, by_load, group_nodes)
        trial = list(loads)
        for u, g in zip(chunk, picks):
            trial[g] += u.tokens
        if max(trial) - min(trial) > bound:
            picks = by_load[: len(chunk)]
        for u, g in zip(chunk, picks):
            loads[g] += u.tokens
            out[g].append(u.key)
    return [sorted(keys) for keys in out]
