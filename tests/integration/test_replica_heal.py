"""``ReplicaGroup`` in one process (two replicas, a thread each, a real etcd and gloo):

- a heal cut short by its source's death leaves the receiver torn (its counter and first tensor
  new, the rest old): it counts as at no place and is never a source, so with no whole member
  left the next generation raises ``QuorumLost`` (the checkpoint restart) instead of training
  on with a mix of two states (before, the retry saw equal, stale progress and did not heal);
- a replica whose layout differs from a live member's is refused by name when it registers;
- generations that form in etcd and break at their rendezvous, again and again, end in
  ``QuorumLost`` after ``quorum_timeout_s`` (without the deadline the test never ends).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.elastic.quorum import LayoutMismatch, Quorum, QuorumLost
from spmd_rl.elastic.replica_group import ReplicaGroup


def test_a_heal_cut_short_by_its_source_leaves_no_torn_replica_training(etcd):
    groups = {n: ReplicaGroup(MetadataStore([etcd.endpoint], "torn"), n, lease_s=2, join_window_s=0.3) for n in "ab"}
    with ThreadPoolExecutor(2) as pool:
        assert [f.result().members for f in [pool.submit(groups[n].start, 2) for n in "ab"]] == [("a", "b")] * 2
    state = {n: [torch.full((4,), float(i)), torch.full((4,), 10.0 + i)] for i, n in enumerate("ab")}
    died = threading.Event()

    def source_state():  # a, furthest ahead, heals b and dies after its first tensor
        yield state["a"][0]
        groups["a"].pg.abort()
        groups["a"].quorum.close()
        groups["a"].tcp = None
        died.set()
        raise SystemExit

    def a_recovers():
        groups["a"].arrivals.leave = lambda: None  # it dies: nothing more of it reaches the store
        groups["a"].recover(source_state, torch.tensor([2.0]))

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(a_recovers)
        b = pool.submit(groups["b"].recover, lambda: iter(state["b"]), torch.tensor([1.0]))
        with pytest.raises(QuorumLost, match="no member holds a whole training state"):
            b.result(timeout=120)
        assert died.is_set() and isinstance(a.exception(timeout=60), SystemExit)
    assert torch.equal(state["b"][0], state["a"][0]) and torch.equal(state["b"][1], torch.full((4,), 11.0))
    groups["b"].close()


def test_a_replica_of_another_layout_is_refused_by_name(etcd):
    store = MetadataStore([etcd.endpoint], "layouts")
    m = Quorum(store, "m", "127.0.0.1:1", layout={"ranks": 2, "rollout.n": 8})
    m.register()
    try:
        n = Quorum(store, "n", "127.0.0.1:2", layout={"ranks": 1, "rollout.n": 8})
        with pytest.raises(LayoutMismatch, match=r"ranks \(1 here, 2 there\)"):
            n.register()
        same = Quorum(store, "o", "127.0.0.1:3", layout={"ranks": 2, "rollout.n": 8})
        same.register()
        same.close()
    finally:
        m.close()


def test_generations_that_keep_breaking_end_in_quorum_lost(etcd):
    """b cannot form any group with a (as when a replica publishes an address the others cannot
    reach): every generation forms in etcd and breaks at its rendezvous. Both stop with
    ``QuorumLost`` (the checkpoint restart) once ``quorum_timeout_s`` has passed since the loss,
    instead of forming a new generation every few seconds for ever."""
    groups = {
        n: ReplicaGroup(
            MetadataStore([etcd.endpoint], "breaking"), n, lease_s=2, join_window_s=0.3, timeout_s=2, quorum_timeout_s=4
        )
        for n in "ab"
    }
    with ThreadPoolExecutor(2) as pool:
        assert [f.result().members for f in [pool.submit(groups[n].start, 2) for n in "ab"]] == [("a", "b")] * 2

    def unreachable(*args, **kwargs):
        raise RuntimeError("connect: no route to host")

    groups["b"].pg.configure = unreachable
    state = {n: [torch.zeros(2)] for n in "ab"}
    with ThreadPoolExecutor(2) as pool:
        got = [pool.submit(groups[n].recover, lambda n=n: iter(state[n]), torch.tensor([1.0])) for n in "ab"]
        for f in got:
            with pytest.raises(QuorumLost, match="no generation of replicas held together"):
                f.result(timeout=120)
    assert groups["a"].gen.number >= 2  # several generations formed and broke before it gave up
    for g in groups.values():
        g.close()
