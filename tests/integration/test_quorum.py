"""``elastic.quorum`` against a real etcd: a joiner alone does not decide a generation while the
members live, however long past its join window (it would have nobody to heal from); the
generation the members then agree on lists the previous one's members first, so member 0 (whose
state heals the joiners, whose store hosts the group) has trained even when a joiner's name
sorts first; a replica that asks to join a job with no generation is told so."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.elastic.quorum import Quorum, QuorumLost


def quorums(etcd, job: str, names: str) -> dict[str, Quorum]:
    store = MetadataStore([etcd.endpoint], job=job)
    return {n: Quorum(store, n, f"127.0.0.1:{1000 + i}", lease_s=3, join_window_s=0.5) for i, n in enumerate(names)}


def test_a_joiner_waits_for_the_members_and_is_not_member_zero(etcd):
    q = quorums(etcd, "quorum-order", "mna")
    for x in q.values():
        x.register()
    try:
        with ThreadPoolExecutor(3) as pool:
            first = [pool.submit(q[n].agree, 0, 2) for n in "mn"]
            assert {f.result().members for f in first} == {("m", "n")}
            joiner = pool.submit(q["a"].agree, 1)
            time.sleep(1.5)  # three join windows: the members are between steps
            assert not joiner.done() and q["m"].latest().number == 0
            gens = [f.result() for f in [pool.submit(q[n].agree, 1) for n in "mn"] + [joiner]]
        assert all(g == gens[0] for g in gens)  # one decision, read by all
        assert gens[0].members == ("m", "n", "a") and gens[0].store_address == "127.0.0.1:1000"
    finally:
        for x in q.values():
            x.close()


def test_joining_before_any_generation_is_refused(etcd):
    (q,) = quorums(etcd, "quorum-empty", "z").values()
    with pytest.raises(QuorumLost, match="nothing to join"):
        q.current()
