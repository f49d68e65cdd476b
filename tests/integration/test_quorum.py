"""``elastic.quorum`` against a real etcd: a joiner alone does not decide a generation while the
members live, however long past its join window (it would have nobody to heal from); the
generation the members then agree on lists the previous one's members first, so member 0 (whose
state heals the joiners, whose store hosts the group) has trained even when a joiner's name
sorts first; a replica that asks to join a job with no generation is told so; a job relaunched
under its name waits for all its replicas."""

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


def test_a_relaunched_job_waits_for_all_its_replicas(etcd):
    """Generation 0 of {m, n} with no process of it alive (both closed); the job is relaunched
    under its name (new processes, new addresses): m alone does not decide generation 1, however
    long past its join window, until n asks too, and with it asked both are members. (Before,
    m decided alone at once and trained from its own checkpoint, maybe older than n's.)"""
    first = quorums(etcd, "quorum-relaunch", "mn")
    for x in first.values():
        x.register()
    with ThreadPoolExecutor(2) as pool:
        assert {f.result().members for f in [pool.submit(first[n].agree, 0, 2) for n in "mn"]} == {("m", "n")}
    for x in first.values():
        x.close()  # the launch ends: leases revoked
    store = MetadataStore([etcd.endpoint], job="quorum-relaunch")
    again = {n: Quorum(store, n, f"127.0.0.1:{2000 + i}", lease_s=3, join_window_s=0.5) for i, n in enumerate("mn")}
    for x in again.values():
        x.register()
    try:
        with ThreadPoolExecutor(2) as pool:
            m = pool.submit(again["m"].agree, 1)
            time.sleep(1.5)  # three join windows
            assert not m.done()
            n = pool.submit(again["n"].agree, 1)
            assert m.result().members == n.result().members == ("m", "n")
            assert m.result().store_address == "127.0.0.1:2000"
    finally:
        for x in again.values():
            x.close()
