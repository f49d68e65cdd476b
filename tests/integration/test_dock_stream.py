"""Streaming gets (``dock.stream``) on a real etcd and a real warehouse: a stage receives a
prefix of the iteration's samples before the last one is written, in etcd's arrival order;
the waves split the same way on every DP group; every sample is delivered exactly once."""

from __future__ import annotations

import threading

import pytest
import torch

from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import DockConfig
from spmd_rl.recipe.graph import Stage
from spmd_rl.dock.client import TransferDock
from spmd_rl.dock.fetch import Peer
from spmd_rl.dock.columns import specs_of
from spmd_rl.recipe.columns import column_decls
from spmd_rl.dock.errors import DockTimeout
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.dock.records import PutRecord
from spmd_rl.dock.stream import ready_order

TOKEN = "unit-test-token-0123456789abcdef"
STAGES = [Stage("actor_rollout", ("prompt_ids",), ("response_ids",)), Stage("reward", ("response_ids",), ("reward",))]
TWO = Layout(2, 1)
ONE_OF_TWO = Layout(1, 2)  # one DP group of both ranks: rank 0 gets every sample


@pytest.fixture
def docks(etcd, request):
    """Two ranks of one node in this process; rank 0 serves the node's warehouse."""
    out = []
    for rank in (0, 1):
        meta = MetadataStore([etcd.endpoint], job=f"stream-{request.node.name}")
        d = TransferDock(
            DockConfig(port=0, get_timeout_s=2.0),
            meta,
            specs_of(column_decls(STAGES)),
            Peer(rank, 2, 0, rank, 2),
            TOKEN,
        ).start()
        d.begin_iteration(0, 8)
        out.append(d)
    yield out
    for d in reversed(out):
        d.close()


def put_responses(dock, indices):
    dock.put(
        "actor_rollout", 0, {"response_ids": [torch.full((i + 1,), i, dtype=torch.int32) for i in indices]}, indices
    )


def check(batch):
    for i, v in zip(batch.indices.tolist(), batch.columns["response_ids"]):
        assert v.tolist() == [i] * (i + 1)
    return batch.indices.tolist()


def test_ready_order_is_arrival_order_then_key():
    recs = [
        (7, PutRecord("a", 0, 0, ["x"], [3, 1])),
        (5, PutRecord("a", 1, 0, ["x"], [2])),
        (9, PutRecord("b", 0, 0, ["y"], [1, 2, 3])),
        (6, PutRecord("b", 0, 0, ["y"], [0])),
        (4, PutRecord("a", 0, 0, ["x"], [0])),
    ]
    assert ready_order(recs, ["x"], range(4)) == [(4, 0), (5, 2), (7, 1), (7, 3)]
    assert ready_order(recs, ["x", "y"], range(4)) == [(6, 0), (9, 1), (9, 2), (9, 3)]
    assert ready_order(recs, ["x"], range(4), group_size=2) == [(7, 0), (7, 1)]  # a group is ready with its last sample
    assert ready_order(recs[:2], ["x"], range(4), group_size=2) == [(7, 1)]


def test_prefix_arrives_before_the_rest_is_written(docks):
    streams = [d.stream("reward", 0, ["response_ids"], TWO, range(8)) for d in docks]  # waves of 2 samples
    got = [[], []]
    assert all(s.poll() is None for s in streams)  # nothing written yet
    put_responses(docks[1], [5, 4])
    for k, s in enumerate(streams):
        got[k] += check(s.next())
    assert sorted(got[0] + got[1]) == [4, 5]  # a prefix, before samples 0-3 and 6-7 exist
    put_responses(docks[0], [2, 0, 1])  # one record: samples 0, 1 and 2 become ready at one revision
    for k, s in enumerate(streams):
        got[k] += check(s.next())
    assert sorted(got[0] + got[1]) == [0, 1, 4, 5]  # same revision: by key
    assert all(s.poll() is None for s in streams)  # only 2 is ready: the next wave needs 2 samples
    put_responses(docks[1], [7, 3, 6])
    for k, s in enumerate(streams):
        got[k] += [i for b in s for i in check(b)]
    assert sorted(got[0] + got[1]) == list(range(8)) and not set(got[0]) & set(got[1])  # exactly once
    assert streams[0].order == streams[1].order == [4, 5, 0, 1, 2, 3, 6, 7]
    assert all(s.done and s.next() is None for s in streams)


def test_group_waves_hold_whole_groups_and_wake_on_the_watch(docks):
    streams = [d.stream("reward", 0, ["response_ids"], TWO, range(8), group_size=2) for d in docks]  # waves of 2 groups
    put_responses(docks[0], [6, 7, 0])
    later = threading.Timer(0.3, put_responses, args=(docks[1], [1]))
    later.start()
    shares = [check(s.next()) for s in streams]  # blocks until the watch reports sample 1
    later.join()
    assert sorted(shares[0] + shares[1]) == [0, 1, 6, 7]
    assert all(len(sh) == 2 and sh[0] // 2 == sh[1] // 2 for sh in shares)  # one whole group each
    put_responses(docks[0], [2, 3, 4, 5])
    rest = [[i for b in s for i in check(b)] for s in streams]
    assert sorted(rest[0] + rest[1]) == [2, 3, 4, 5]


def test_a_stalled_stream_names_what_is_missing(docks):
    put_responses(docks[0], [0, 1, 2])
    s = docks[0].stream("reward", 0, ["response_ids"], TWO, range(8))
    assert sorted(check(s.next())) in ([0], [1], [0, 1])
    with pytest.raises(
        DockTimeout, match=r"streamed 2 of 8 units.*'response_ids' \(written by stage actor_rollout\): missing 3-7"
    ):
        s.next()


def test_streams_of_one_iteration_share_one_watch(docks):
    reward = docks[0].stream("reward", 0, ["response_ids"], ONE_OF_TWO, range(4))
    other = docks[0].stream("advantage", 0, ["response_ids"], ONE_OF_TWO, range(4, 8))
    assert reward.feed is other.feed
    put_responses(docks[1], [0, 1, 2, 3, 4, 5, 6, 7])
    assert [i for b in reward for i in check(b)] == [0, 1, 2, 3]  # one change seen by both streams
    assert [i for b in other for i in check(b)] == [4, 5, 6, 7]
    docks[0].commit(0)
    assert not reward.feed.watching  # the commit ends the iteration's watch
