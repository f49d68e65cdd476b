"""PeerWatch against a real etcd: once armed it reports a rank whose lease expired and a
warehouse whose server stopped (its rank alive), naming them; an unreachable etcd is no
evidence and reports nothing. The multi-process consequences (exit, torchrun restart) are in
test_node_loss_torchrun.py and test_restart_torchrun.py."""

from __future__ import annotations

import threading

import pytest

from spmd_rl.dock.heartbeat import Heartbeat, PeerWatch
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.dock.node_lease import NodeLease
from spmd_rl.dock.presence import presence_name


def watch(meta, world: int, warehouses: list[int]) -> tuple[PeerWatch, list[str], threading.Event]:
    reasons: list[str] = []
    fired = threading.Event()

    def lost(reason: str) -> None:
        reasons.append(reason)
        fired.set()

    return PeerWatch(meta, world, warehouses, lost, poll_s=0.2, grace_s=0.5).start(), reasons, fired


@pytest.mark.timeout(60)
def test_expired_rank_lease_is_reported(etcd):
    meta = MetadataStore([etcd.endpoint], job="watch-rank")
    beats = [Heartbeat(meta, r, ttl_s=3).start() for r in (0, 1)]
    w, reasons, fired = watch(meta, 2, [])
    try:
        assert not fired.wait(1.5)  # both alive: nothing to report
        beats[1].stop()  # rank 1 "dies": its key expires after the lease
        assert fired.wait(30)
        assert reasons == ["rank 1 lost (liveness key expired or withdrawn)"]
    finally:
        w.stop()
        beats[0].stop()


@pytest.mark.timeout(60)
def test_stopped_warehouse_is_reported_while_its_rank_lives(etcd):
    meta = MetadataStore([etcd.endpoint], job="watch-warehouse")
    serving = threading.Event()
    serving.set()
    lead = NodeLease(meta, 0, [0], 3, presence_name(b"watch-warehouse"), warehouse=0, healthy=serving.is_set).start()
    w, reasons, fired = watch(meta, 1, [0])
    try:
        assert not fired.wait(1.5)
        serving.clear()  # the server thread stopped: the node's lead withdraws its key at once
        assert fired.wait(30)
        assert reasons == ["warehouse of node 0 lost (liveness key expired or withdrawn)"]
    finally:
        w.stop()
        lead.stop()


@pytest.mark.timeout(60)
def test_a_key_back_within_the_grace_is_no_loss_and_lost_ranks_waits_for_the_grace(etcd):
    """A lease that lapsed on an overloaded etcd and was taken again within ``grace_s`` loses
    nobody; a key that stays gone does, in ``on_lost`` and in ``lost_ranks`` (the view the
    dock's waits read instead of etcd) only after the grace."""
    meta = MetadataStore([etcd.endpoint], job="watch-grace")
    for r in (0, 1):
        meta.put(meta.key("alive", r), b"1")
    w, reasons, fired = watch(meta, 2, [])  # grace 0.5 s, polled every 0.2 s
    try:
        assert w.lost_ranks() == set()  # the view exists as soon as start returns
        for _ in range(3):
            meta.delete(meta.key("alive", 1))
            meta.put(meta.key("alive", 1), b"1")  # back at once: a re-registered lease
            assert not fired.wait(0.7)
        assert w.lost_ranks() == set()
        meta.delete(meta.key("alive", 1))
        assert w.lost_ranks() == set()  # within the grace: not yet
        assert fired.wait(10)
        assert w.lost_ranks() == {1} and reasons == ["rank 1 lost (liveness key expired or withdrawn)"]
    finally:
        w.stop()


class Unreachable:
    """A metadata store whose etcd is away."""

    def key(self, *parts):
        return "/x/" + "/".join(map(str, parts))

    def get_prefix_at(self, prefix):
        raise ConnectionError("etcd unreachable")

    def watch_prefix(self, prefix, start_revision=None):
        raise ConnectionError("etcd unreachable")


def test_unreachable_etcd_is_no_evidence():
    w, reasons, fired = watch(Unreachable(), 2, [0])
    try:
        assert not fired.wait(2.0)  # ten polls, all failing: nobody is declared lost
    finally:
        w.stop()
    assert reasons == []
