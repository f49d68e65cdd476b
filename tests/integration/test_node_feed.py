"""One record feed per node (``dock.feed_host``, ``dock.node_feed``) on a real etcd and real
warehouses: two simulated nodes of two ranks in this process.

Invariants: etcd streams the iteration's records to one watch per node (per group of nodes
with ``dock.records_group_nodes``: the group's other warehouses follow its first), and the
node's other rank reads none of them from etcd, yet sees every record; a duplicate put is refused on every
rank; the drop of an iteration closes its feed and a follower's late ask does not reopen it;
an idle follower's long poll costs its warehouse about one ask per ``wait_s``; the warehouse
resyncs its feed after an etcd restart without any rank asking it to.
"""

from __future__ import annotations

import time

import pytest
import torch

from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import DockConfig
from spmd_rl.dock.client import TransferDock
from spmd_rl.dock.columns import specs_of
from spmd_rl.recipe.columns import column_decls
from spmd_rl.dock.errors import DockRequestError
from spmd_rl.dock.etcd_server import EmbeddedEtcd
from spmd_rl.dock.feed import RecordFeed
from spmd_rl.dock.feed_host import FeedHost
from spmd_rl.dock.fetch import Peer
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.dock.node_feed import NodeFeed
from spmd_rl.dock.records import PutRecord
from spmd_rl.recipe.graph import Stage

TOKEN = "node-feed-test-token-0123456789ab"
STAGES = [Stage("actor_rollout", ("prompt_ids",), ("response_ids",)), Stage("reward", (), ("reward",))]
N = 8


class CountingStore(MetadataStore):
    """Counts the record reads and watches this rank makes of etcd."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str]] = []

    def watch_prefix(self, prefix, *args, **kwargs):
        self.calls.append(("watch", prefix))
        return super().watch_prefix(prefix, *args, **kwargs)

    def get_prefix_at(self, prefix):
        self.calls.append(("read", prefix))
        return super().get_prefix_at(prefix)


@pytest.fixture
def docks(etcd, request):
    """Groups of one node each (every warehouse watches etcd), unless the test is parametrized
    with ``group``."""
    group = getattr(request, "param", 1)
    out = []
    for rank in range(4):
        meta = CountingStore([etcd.endpoint], job=f"node-feed-{request.node.name}")
        d = TransferDock(
            DockConfig(port=0, get_timeout_s=20, records_group_nodes=group),
            meta,
            specs_of(column_decls(STAGES)),
            Peer(rank, 4, rank // 2, rank % 2, 2),
            TOKEN,
        ).start()
        d.begin_iteration(0, N)
        out.append(d)
    yield out
    for d in reversed(out):
        d.close()


def responses(indices):
    return {"response_ids": [torch.full((i + 1,), i, dtype=torch.int32) for i in indices]}


def record_calls(d: TransferDock) -> list[tuple[str, str]]:
    return [c for c in d.meta.calls if "/puts/" in c[1]]


def test_one_watch_per_node_and_the_other_rank_reads_no_record_from_etcd(docks):
    for r, d in enumerate(docks):
        d.put("actor_rollout", 0, responses([2 * r, 2 * r + 1]), [2 * r, 2 * r + 1])
    got = {}
    for r in (1, 3):  # the non-serving ranks: every record, from their warehouse
        batch = docks[r].get("actor_update", 0, ["response_ids"], Layout(1, 4), timeout_s=20)
        got[r] = batch.indices.tolist()
        assert [v.tolist() for v in batch.columns["response_ids"]] == [[i] * (i + 1) for i in range(N)]
        assert isinstance(docks[r].feed(0), NodeFeed)
    assert got[1] == got[3] == list(range(N))
    assert isinstance(docks[0].feed(0), RecordFeed) and docks[0].feed(0) is docks[0].server.feeds.open(0)
    for r in (0, 2):
        assert [k for k, _ in record_calls(docks[r])] == ["read", "watch"]  # one read, one watch per node
    for r in (1, 3):
        assert record_calls(docks[r]) == []


@pytest.mark.parametrize("docks", [2], indirect=True)
def test_one_watch_per_group_of_nodes_and_the_other_warehouse_follows_the_first(docks):
    """Both nodes in one group: node 0's warehouse alone reads and watches etcd, node 1's
    learns every record from it, and every rank still sees every record. A dock that ignored
    the group would show node 1's warehouse reading and watching etcd too."""
    for r, d in enumerate(docks):
        d.put("actor_rollout", 0, responses([2 * r, 2 * r + 1]), [2 * r, 2 * r + 1])
    for r in range(4):
        batch = docks[r].get("actor_update", 0, ["response_ids"], Layout(1, 4), timeout_s=20)
        assert batch.indices.tolist() == list(range(N))
        assert [v.tolist() for v in batch.columns["response_ids"]] == [[i] * (i + 1) for i in range(N)]
    assert isinstance(docks[0].feed(0), RecordFeed)
    assert isinstance(docks[2].feed(0), NodeFeed) and docks[2].feed(0).address == docks[0].server.address
    assert [k for k, _ in record_calls(docks[0])] == ["read", "watch"]
    for r in (1, 2, 3):
        assert record_calls(docks[r]) == []
    docks[0].commit(0)  # the first warehouse drops the iteration: the one following it sees its feed end
    deadline = time.monotonic() + 5
    while docks[2].feed(0).watching and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not docks[2].feed(0).watching


def test_a_duplicate_is_refused_on_a_following_rank(docks):
    docks[2].put("actor_rollout", 0, responses([5]), [5])  # another node
    feed = docks[1].feed(0)
    deadline = time.monotonic() + 10
    while feed.written("response_ids", 5) is None and time.monotonic() < deadline:
        feed.wait_change(feed.version, 0.2)
    with pytest.raises(DockRequestError, match=r"'response_ids' already written for indices \[5\] by .*rank 2"):
        docks[1].put("actor_rollout", 0, responses([5]), [5])


def test_the_drop_closes_the_feed_and_a_late_ask_does_not_reopen_it(docks):
    docks[1].put("reward", 0, {"reward": torch.ones(N)}, range(N))
    follower = docks[1].feed(0)
    host = docks[0].server.feeds
    assert follower.watching and host.lookup(0, None) is not None
    docks[0].commit(0)  # drops iteration 0 on node 0's warehouse
    deadline = time.monotonic() + 5
    while follower.watching and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not follower.watching and host._feeds == {}
    late = docks[1].client(0)  # a follower's ask for the closed feed, after the drop
    head = late.request({"op": "records", "iter": 0, "since": 0, "feed": follower._feed_id, "wait_s": 0})[0][0]
    assert head == {"closed": True, "last": True} and host._feeds == {}


def test_an_idle_follower_asks_about_once_per_wait(docks):
    handled, handle = [0], docks[0].server._handle

    def counted(frames, peer, ident=None):
        handled[0] += 1
        return handle(frames, peer, ident)

    docks[0].server._handle = counted
    follower = NodeFeed(docks[1].client(0).address, TOKEN, 0, wait_s=0.5)
    before = handled[0]
    time.sleep(2.0)  # nothing is put: every ask is held 0.5 s
    idle_asks = handled[0] - before
    assert 2 <= idle_asks <= 6, idle_asks
    seen, t0 = follower.version, time.monotonic()  # read before the put: the record may arrive before a later read
    docks[2].put("actor_rollout", 0, responses([0]), [0])
    assert follower.wait_change(seen, 5) and follower.written("response_ids", 0) is not None
    print(f"idle asks in 2 s: {idle_asks}; a record reached the follower in {time.monotonic() - t0:.3f} s")
    follower.stop()


def test_the_warehouse_resyncs_its_feed_after_an_etcd_restart(tmp_path):
    etcd = EmbeddedEtcd(data_dir=str(tmp_path)).start()
    port = etcd.client_port
    meta = MetadataStore([etcd.endpoint], job="node-feed-restart", retry_s=30)
    host = FeedHost(meta, heal_every_s=0.2)
    try:
        feed = host.open(0)
        etcd.stop()
        time.sleep(1.0)
        etcd = EmbeddedEtcd(client_port=port, data_dir=str(tmp_path)).start()
        meta.put(meta.key(0, "puts", "a"), PutRecord("gen", 0, 0, ["x"], [0]).encode())
        deadline = time.monotonic() + 20
        while not (feed.ready(["x"], [0]) and feed.watching) and time.monotonic() < deadline:
            feed.wait_change(feed.version, 0.2)  # (the resync's read lands before its watch starts)
        assert feed.ready(["x"], [0]) and feed.watching  # nobody called resync: the keeper did
    finally:
        host.close()
        etcd.stop()
