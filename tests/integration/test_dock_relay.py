"""TP leader fetch (``dock.relay``) on a real etcd and real warehouses: two simulated nodes of two
ranks in this process, training TP 2 (DP group 0 on node 0, group 1 on node 1).

Node 0 holds every response, so group 1's whole share is remote. Invariants: each rank receives
exactly the samples it would fetch itself, bit for bit, with the relay and without it; with the
relay the remote share leaves node 0's warehouse once for group 1, not once per TP rank, and
the difference is exactly that share's bytes; a TP rank waiting for a leader whose heartbeat
expired fails within seconds, not ``dock.get_timeout_s``; the relay stays off at TP 1 and
below ``dock.tp_relay_min_bytes``; a streamed wave's poll never waits for the leader.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import DockConfig
from spmd_rl.recipe.graph import Stage
from spmd_rl.dock.client import TransferDock
from spmd_rl.dock.fetch import Peer
from spmd_rl.dock.columns import specs_of
from spmd_rl.recipe.columns import column_decls
from spmd_rl.dock.errors import DockUnavailable
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.dock.relay import plan_relay

TOKEN = "relay-test-token-0123456789abcdef"
STAGES = [Stage("actor_rollout", ("prompt_ids",), ("response_ids",)), Stage("reward", (), ("reward",))]
TRAIN = Layout(2, 2)
N = 16


def responses() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(0, 2**31 - 1, (int(n),), generator=g, dtype=torch.int32)
        for n in torch.randint(2000, 9000, (N,), generator=g)
    ]


def four_ranks(etcd, job: str, relay_min: int | None, ttl: int | None = None) -> list[TransferDock]:
    docks = []
    for rank in range(4):
        cfg = DockConfig(port=0, get_timeout_s=60, tp_relay_min_bytes=relay_min)
        d = TransferDock(
            cfg,
            MetadataStore([etcd.endpoint], job=job),
            specs_of(column_decls(STAGES)),
            Peer(rank, 4, rank // 2, rank % 2, 2),
            TOKEN,
        )
        docks.append(d.start(heartbeat_ttl_s=ttl))
    for d in docks:
        d.begin_iteration(0, N)
    docks[0].put("actor_rollout", 0, {"response_ids": responses()[: N // 2]}, range(N // 2))
    docks[1].put("actor_rollout", 0, {"response_ids": responses()[N // 2 :]}, range(N // 2, N))
    docks[1].put("reward", 0, {"reward": torch.arange(N, dtype=torch.float32)}, range(N))
    return docks


def get_all(docks: list[TransferDock]) -> list:
    """Every rank's get of the update stage, concurrently (TP ranks wait for their leader)."""
    out, errors = [None] * len(docks), []

    def one(r):
        try:
            out[r] = docks[r].get("actor_update", 0, ["response_ids", "reward"], TRAIN)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(docks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return out


@pytest.mark.timeout(180)
def test_tp_ranks_receive_their_own_share_with_one_remote_copy(etcd):
    want = responses()
    sent = {}
    for relay_min in (None, 0):
        docks = four_ranks(etcd, f"relay-{relay_min}", relay_min)
        try:
            got = get_all(docks)
            for r in range(4):
                idx = got[r].indices.tolist()
                assert got[r].indices.equal(got[r ^ 1].indices)  # the TP peers' share
                assert all(torch.equal(v, want[i]) for v, i in zip(got[r].columns["response_ids"], idx))
                assert [v.item() for v in got[r].columns["reward"]] == [float(i) for i in idx]
            remote = sum(want[i].numel() * 4 + 4 for i in got[2].indices.tolist())
            assert remote > 0 and all(i < N for i in got[2].indices.tolist())
            sent[relay_min] = (docks[0].warehouse_stats()["bytes_out"], docks[2].warehouse_stats(), remote)
            relayed = sum(
                k.startswith(docks[0].meta.key(0, "relay"))
                for k, _ in docks[0].meta.get_prefix(docks[0].meta.key(0) + "/")
            )
            assert relayed == (1 if relay_min == 0 else 0)  # one key: group 1's (group 0's share is all local)
            docks[0].commit(0)
            docks[2].commit(0)
            assert docks[2].warehouse_stats()["samples"] == 0  # the relay columns go with the iteration
        finally:
            for d in reversed(docks):
                d.close()
    (out_plain, node1_plain, remote), (out_relay, node1_relay, _) = sent[None], sent[0]
    assert out_plain - out_relay == remote  # node 0 sends group 1's share once instead of twice
    assert node1_plain["bytes_in"] == 0 and node1_relay["bytes_in"] == node1_relay["bytes_out"] == remote


@pytest.mark.timeout(120)
def test_relay_only_where_it_pays(etcd):
    docks = four_ranks(etcd, "relay-plan", 10 << 20)  # above the remote share (about 180 KiB)
    try:
        from spmd_rl.dock.feed import RecordFeed

        feed = RecordFeed(docks[2].meta, 0)  # its first read: every record, all puts being done
        loc = feed.locations()
        feed.stop()
        share = list(range(N))
        assert plan_relay(docks[2], "s", 0, TRAIN, share, ["response_ids"], loc) is None  # below the bound
        docks[2].cfg = DockConfig(port=0, tp_relay_min_bytes=0)
        assert plan_relay(docks[2], "s", 0, Layout(4, 1), share, ["response_ids"], loc) is None  # TP 1
        first = plan_relay(docks[2], "s", 0, TRAIN, share, ["response_ids"], loc)
        again = plan_relay(docks[2], "s", 0, TRAIN, share, ["response_ids"], loc)
        assert (
            first.leader
            and first.remote == tuple(range(N))
            and (first.name, again.name) == ("relay/s/0/1", "relay/s/1/1")
        )
        assert plan_relay(docks[0], "s", 0, TRAIN, share, ["response_ids"], loc) is None  # group 0's data is all local
    finally:
        for d in reversed(docks):
            d.close()


@pytest.mark.timeout(120)
def test_a_tp_rank_does_not_wait_for_a_lost_leader(etcd):
    docks = four_ranks(etcd, "relay-lost", 0, ttl=2)
    try:
        docks[2].heartbeat.stop()  # group 1's leader dies before it relays anything
        t0 = time.monotonic()
        # the leader is its node's local rank 0: its node's lease, and rank 3's key, go with it
        with pytest.raises(DockUnavailable, match=r"rank\(s\) \[2, 3\] lost"):
            docks[3].get("actor_update", 0, ["response_ids", "reward"], TRAIN)  # the liveness path, not DockTimeout
        print(f"lost TP leader detected in {time.monotonic() - t0:.1f} s (dock.get_timeout_s is 60)")
    finally:
        for d in reversed(docks):
            d.close()


@pytest.mark.timeout(120)
def test_a_streamed_wave_never_waits_for_the_tp_leader(etcd):
    """Stage fusion polls between generation steps, where a TP peer may be inside a collective
    with this rank: a poll that waited for the leader's relay could deadlock, so waves are
    fetched by each rank itself, however remote and big they are."""
    docks = four_ranks(etcd, "relay-stream", 0)
    try:
        t0 = time.monotonic()
        wave = docks[3].stream("actor_update", 0, ["response_ids", "reward"], TRAIN, range(N), units_per_group=N).poll()
        print(f"wave fetched in {time.monotonic() - t0:.1f} s; the leader (rank 2) never polls")
        want = responses()
        assert len(wave) > 0 and all(
            torch.equal(v, want[i]) for v, i in zip(wave.columns["response_ids"], wave.indices.tolist())
        )
        assert not [k for k, _ in docks[3].meta.get_prefix(docks[3].meta.key(0, "relay"))]
    finally:
        for d in reversed(docks):
            d.close()


def test_the_leader_fetches_in_buckets():
    from spmd_rl.dock.relay import _chunks

    assert _chunks([5, 5, 5, 20, 1], 10) == [(0, 2), (2, 3), (3, 4), (4, 5)]  # a sample over the bucket goes alone
    assert _chunks([3], 1) == [(0, 1)]
