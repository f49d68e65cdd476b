"""Properties of the controllers' assignment function (hypothesis)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from spmd_rl.dock.assign import Unit, assign
from spmd_rl.dock.controller import split
from spmd_rl.dock.records import Locations

varied_st = st.lists(st.tuples(st.integers(1, 500), st.integers(0, 3)), min_size=0, max_size=120).map(
    lambda xs: [Unit(k, t, n) for k, (t, n) in enumerate(xs)]
)
equal_st = st.tuples(st.integers(1, 500), st.lists(st.integers(0, 3), min_size=1, max_size=120)).map(
    lambda x: [Unit(k, x[0], n) for k, n in enumerate(x[1])]
)
units_st = st.one_of(varied_st, equal_st)  # equal sizes take the quota path (_assign_equal)
groups_st = st.lists(st.integers(0, 3), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(units_st, groups_st)
def test_each_unit_exactly_once_and_sizes_within_one(units, group_nodes):
    out = assign(units, group_nodes)
    flat = [k for g in out for k in g]
    assert sorted(flat) == sorted(u.key for u in units)
    sizes = [len(g) for g in out]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=300, deadline=None)
@given(units_st, groups_st)
def test_token_balance_within_one_longest_unit(units, group_nodes):
    out = assign(units, group_nodes)
    tokens = {u.key: u.tokens for u in units}
    loads = [sum(tokens[k] for k in g) for g in out]
    longest = max((u.tokens for u in units), default=0)
    assert max(loads) - min(loads) <= longest


@settings(max_examples=200, deadline=None)
@given(units_st, groups_st, st.randoms(use_true_random=False))
def test_same_result_whatever_the_order_controllers_saw(units, group_nodes, rnd):
    shuffled = list(units)
    rnd.shuffle(shuffled)
    assert assign(units, group_nodes) == assign(shuffled, group_nodes)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 6), st.integers(1, 300))
def test_equal_units_stay_on_their_node(nodes, groups_per_node, per_group, tokens):
    group_nodes = [n for n in range(nodes) for _ in range(groups_per_node)]
    units = [Unit(k, tokens, k % nodes) for k in range(nodes * groups_per_node * per_group)]
    random.Random(0).shuffle(units)
    out = assign(units, group_nodes)
    node_of = {u.key: u.node for u in units}
    assert all(node_of[k] == group_nodes[g] for g, keys in enumerate(out) for k in keys)


def test_locality_preferred_when_lengths_vary_a_little():
    # two nodes, one group each; every unit local to node 0 or 1 in equal numbers
    units = [Unit(k, 100 + (k % 3), k % 2) for k in range(40)]
    out = assign(units, [0, 1])
    local = sum(k % 2 == g for g, keys in enumerate(out) for k in keys)
    assert local >= 30


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 6), st.integers(1, 300))
def test_equal_units_in_node_blocks_stay_local(nodes, groups_per_node, per_group, tokens):
    """Writers put contiguous index blocks on their own node (the generation DP layout)."""
    group_nodes = [n for n in range(nodes) for _ in range(groups_per_node)]
    per_node = groups_per_node * per_group
    units = [Unit(k, tokens, k // per_node) for k in range(nodes * per_node)]
    out = assign(units, group_nodes)
    assert all(k // per_node == group_nodes[g] for g, keys in enumerate(out) for k in keys)


@settings(max_examples=300, deadline=None)
@given(equal_st, groups_st)
def test_equal_units_keep_the_most_local_split_the_quotas_allow(units, group_nodes):
    """Quotas n // d (+1 for the first n % d groups): no split with them keeps more units on
    their own node than sum over nodes of min(units there, quota of the groups there)."""
    d, n = len(group_nodes), len(units)
    quota = [n // d + (g < n % d) for g in range(d)]
    out = assign(units, group_nodes)
    assert [len(keys) for keys in out] == quota
    node_of = {u.key: u.node for u in units}
    local = sum(node_of[k] == group_nodes[g] for g, keys in enumerate(out) for k in keys)
    best = sum(
        min(sum(u.node == node for u in units), sum(q for q, gn in zip(quota, group_nodes) if gn == node))
        for node in set(group_nodes)
    )
    assert local == best


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4),  # parts (mini-batches)
    st.integers(1, 4),  # DP groups
    st.integers(1, 3),  # samples per group and part, per DP group
    st.data(),
)
def test_parts_are_the_same_samples_whatever_the_dp_groups(parts, d, per, data):
    """``split`` with parts (the mini-batched stages): DP group g's indices are its run of part
    0, then of part 1, ..., each run the same length on every group; so each group's p-th run
    lies inside part p, and part p is the same indices for 1 DP group or d. One assignment of
    the whole (parts=1) puts a length-balanced, layout-dependent set first."""
    n = parts * d * per
    lengths = data.draw(st.lists(st.integers(1, 50), min_size=n, max_size=n))
    loc = Locations(
        node={"response_ids": dict.fromkeys(range(n), 0)}, length={"response_ids": dict(enumerate(lengths))}
    )
    expected = list(range(n))
    groups = split(loc, ["response_ids"], expected, [0] * d, parts=parts)
    size = n // parts
    for p in range(parts):
        runs = [g[p * d * per // d : (p + 1) * d * per // d] for g in groups]
        assert sorted(i for run in runs for i in run) == expected[p * size : (p + 1) * size]
    assert sorted(i for g in groups for i in g) == expected


def test_one_assignment_of_the_whole_mixes_the_parts():
    """The broken version: the same call without parts gives a group a first run that is not
    part 0 (group 0 gets 0, 1, 2 and 4; group 1 starts 3, 5), which is what the parts fix."""
    lengths = [1, 50, 2, 50, 50, 50, 1, 2]
    loc = Locations(
        node={"response_ids": dict.fromkeys(range(8), 0)}, length={"response_ids": dict(enumerate(lengths))}
    )
    whole = split(loc, ["response_ids"], list(range(8)), [0, 0])
    assert sorted(whole[0][:2] + whole[1][:2]) != [0, 1, 2, 3]
    by_parts = split(loc, ["response_ids"], list(range(8)), [0, 0], parts=2)
    assert sorted(by_parts[0][:2] + by_parts[1][:2]) == [0, 1, 2, 3]
