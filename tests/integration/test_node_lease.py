"""One lease per node against a real etcd (``dock.node_lease``): the node's ranks and its
warehouse hold their keys under the lead's lease, the other ranks (here separate processes)
beat on the lead's board, and the peer watch sees the same losses as with a lease per rank:
a rank that stops beating, a lead that stops renewing (its whole node), a warehouse that stops
serving. A broken version this fails: a lease per rank (more than one lease id on the node's
keys), a lead that never withdraws a silent rank's key or never puts it back, a lapsed lease
replaced without the keys of the ranks that still beat."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from spmd_rl.dock.heartbeat import PeerWatch
from spmd_rl.dock.metadata import LeaseId, MetadataStore
from spmd_rl.dock.node_lease import RECORD, NodeLease, RankBeat
from spmd_rl.dock.presence import presence_name
from tests.conftest import REPO

TTL = 3
NAME = presence_name(b"node lease test key")
BEAT = """
import sys, time
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.dock.node_lease import RankBeat
endpoint, job, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
RankBeat(MetadataStore([endpoint], job), 0, rank, rank, {ttl}, 30, "{name}").start()
print("started", flush=True)
time.sleep(600)
""".format(ttl=TTL, name=NAME)


def beat_in_a_process(etcd, job: str, rank: int) -> subprocess.Popen:
    """Local rank ``rank`` of node 0 in its own process; returns once its key is put."""
    p = subprocess.Popen(
        [sys.executable, "-c", BEAT, etcd.endpoint, job, str(rank)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "started"
    return p


def leases(meta: MetadataStore, kind: str) -> dict[int, int]:
    """Who holds a key of ``kind`` -> the id of the lease it is under."""
    prefix = meta.key(kind) + "/"
    got = meta._client().get_prefix(prefix)
    return {int(m["key"].decode()[len(prefix) :]): int(m.get("lease", 0)) for _, m in got}


def wait_until(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def node(etcd, request):
    """Node 0 of three ranks: the lead here (serving node 0's warehouse), ranks 1 and 2 beating
    from their own processes."""
    job = f"lease-{request.node.name[:40]}"
    meta = MetadataStore([etcd.endpoint], job)
    serving = threading.Event()
    serving.set()
    lead = NodeLease(meta, 0, [0, 1, 2], TTL, NAME, warehouse=0, healthy=serving.is_set).start()
    procs = [beat_in_a_process(etcd, job, r) for r in (1, 2)]
    yield meta, lead, procs, serving
    lead.stop()
    for p in procs:
        p.kill()
        p.wait()


def watch(meta) -> tuple[PeerWatch, list[str]]:
    reasons: list[str] = []
    return PeerWatch(meta, 3, [0], reasons.append, poll_s=0.2, grace_s=0.5).start(), reasons


@pytest.mark.timeout(90)
def test_the_nodes_ranks_and_warehouse_hold_their_keys_under_the_leads_one_lease(node):
    meta, lead, _, _ = node
    ranks, houses = leases(meta, "alive"), leases(meta, "warehouse_alive")
    assert sorted(ranks) == [0, 1, 2] and list(houses) == [0]
    assert set(ranks.values()) | set(houses.values()) == {lead._lease.id}
    assert leases(meta, RECORD) == {0: lead._lease.id}  # the record goes with the lease too


@pytest.mark.timeout(90)
def test_a_rank_that_stops_beating_is_lost_alone_and_gets_its_key_back_when_it_beats_again(node):
    meta, _, procs, _ = node
    w, reasons = watch(meta)
    try:
        os.kill(procs[0].pid, signal.SIGSTOP)  # rank 1 hangs: its board slot ages, the lead withdraws its key
        assert wait_until(lambda: 1 not in leases(meta, "alive"))
        assert sorted(leases(meta, "alive")) == [0, 2] and list(leases(meta, "warehouse_alive")) == [0]
        assert wait_until(lambda: reasons == ["rank 1 lost (liveness key expired or withdrawn)"])
        os.kill(procs[0].pid, signal.SIGCONT)  # it beats again: the lead puts its key back
        assert wait_until(lambda: sorted(leases(meta, "alive")) == [0, 1, 2])
    finally:
        w.stop()


@pytest.mark.timeout(90)
def test_a_lead_that_stops_renewing_takes_its_whole_node_with_it(node):
    meta, lead, _, _ = node
    w, reasons = watch(meta)
    try:
        lead.stop()  # ranks 1 and 2 still beat, but their keys are under the lead's lease
        assert wait_until(lambda: not leases(meta, "alive") and not leases(meta, "warehouse_alive"))
        assert wait_until(lambda: len(reasons) == 1)
        assert reasons[0] == "rank 0, rank 1, rank 2, warehouse of node 0 lost (liveness key expired or withdrawn)"
    finally:
        w.stop()


@pytest.mark.timeout(90)
def test_a_warehouse_that_stops_serving_loses_its_key_and_its_ranks_keep_theirs(node):
    meta, _, _, serving = node
    serving.clear()
    assert wait_until(lambda: not leases(meta, "warehouse_alive"))
    time.sleep(TTL + 1)
    assert sorted(leases(meta, "alive")) == [0, 1, 2]


@pytest.mark.timeout(90)
def test_a_lapsed_lease_is_replaced_with_the_keys_of_every_rank_that_still_beats(node):
    """etcd lost the lease (away longer than the TTL; here revoked): the lead takes a new one
    and puts back its own key, the warehouse's, and those of the ranks that beat, not of one
    that went silent."""
    meta, lead, procs, _ = node
    procs[1].kill()  # rank 2 dies
    procs[1].wait()
    assert wait_until(lambda: 2 not in leases(meta, "alive"))
    old = lead._lease.id
    meta._call(lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": old}))
    assert wait_until(lambda: sorted(leases(meta, "alive")) == [0, 1])
    new = leases(meta, "alive")[0]
    assert new != old and set(leases(meta, "alive").values()) == {new}
    assert leases(meta, "warehouse_alive") == {0: new} and leases(meta, RECORD) == {0: new}


@pytest.mark.timeout(90)
def test_a_rank_that_cannot_open_the_leads_board_holds_a_lease_of_its_own(etcd):
    """The record names a board this process cannot open (another pid namespace; here a
    nonexistent fd): after the grace the rank takes its own lease, and its key still exists."""
    meta = MetadataStore([etcd.endpoint], "lease-no-board")
    lease = meta.lease(30)
    record = {"lease": lease.id, "board": {"pid": os.getpid(), "fd": 987654, "ino": 1, "slots": 2}}
    meta.put(meta.key(RECORD, 0), json.dumps(record).encode(), lease=LeaseId(lease.id))
    beat = RankBeat(meta, 0, 1, 1, TTL, 30, NAME)
    beat.record_grace_s = 0.5
    try:
        beat.start()
        assert beat.own is not None and beat.board is None
        held = leases(meta, "alive")
        assert list(held) == [1] and held[1] != lease.id
    finally:
        beat.stop()
