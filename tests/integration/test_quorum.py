"""``elastic.quorum`` against a real etcd: a joiner alone does not decide a generation while the
members live, however long past its join window and its own timeout (it would have nobody to
heal from); the generation the members then agree on lists the previous one's members first, so
member 0 (whose state heals the joiners, whose store hosts the group) has trained even when a
joiner's name sorts first; a slow member (lease live) is waited for however long past the join
window, a killed one (its store port refuses) is left out before its lease lapses; a lease that
lapsed is replaced and the record published again, so a joiner never takes a live job for
relaunched; leases survive losing the etcd endpoint they were granted through; a replica that
asks to join a job with no generation is told so; a job relaunched under its name waits for all
its replicas."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.elastic.quorum import NotAMember, Quorum, QuorumLost

OPEN: list[socket.socket] = []


def listening() -> socket.socket:
    """A port that accepts, as a replica's store does while its process lives."""
    s = socket.create_server(("127.0.0.1", 0))
    OPEN.append(s)
    return s


def quorums(etcd, job: str, names: str, **kw) -> dict[str, Quorum]:
    store = MetadataStore([etcd.endpoint], job=job)
    kw = {"lease_s": 3, "join_window_s": 0.5} | kw
    return {n: Quorum(store, n, f"127.0.0.1:{listening().getsockname()[1]}", **kw) for n in names}


def first_generation(q: dict[str, Quorum], names: str) -> None:
    for x in q.values():
        x.register()
    with ThreadPoolExecutor(len(names)) as pool:
        assert {f.result().members for f in [pool.submit(q[n].agree, 0, len(names)) for n in names]} == {
            tuple(sorted(names))
        }


def test_a_joiner_waits_for_the_members_and_is_not_member_zero(etcd):
    q = quorums(etcd, "quorum-order", "mna")
    q["a"].timeout_s = 1.0  # past its own timeout too: alone with members alive it must not decide
    for x in q.values():
        x.register()
    try:
        with ThreadPoolExecutor(3) as pool:
            first = [pool.submit(q[n].agree, 0, 2) for n in "mn"]
            assert {f.result().members for f in first} == {("m", "n")}
            joiner = pool.submit(q["a"].agree, 1)
            time.sleep(1.5)  # three join windows: the members are between steps
            assert not joiner.done() and q["m"].latest().number == 0
            m = pool.submit(q["m"].agree, 1)
            time.sleep(0.5)  # n asks after m, the joiner long past its own timeout: n is still waited for
            gens = [f.result() for f in [m, pool.submit(q["n"].agree, 1), joiner]]
        assert all(g == gens[0] for g in gens)  # one decision, read by all
        assert gens[0].members == ("m", "n", "a") and gens[0].store_address == q["m"].address
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
    again = quorums(etcd, "quorum-relaunch", "mn")
    for x in again.values():
        x.register()
    try:
        with ThreadPoolExecutor(2) as pool:
            m = pool.submit(again["m"].agree, 1)
            time.sleep(1.5)  # three join windows
            assert not m.done()
            n = pool.submit(again["n"].agree, 1)
            assert m.result().members == n.result().members == ("m", "n")
            assert m.result().store_address == again["m"].address
    finally:
        for x in again.values():
            x.close()


def test_a_slow_member_is_waited_for_past_the_join_window(etcd):
    """Generation 0 of {m, n}; m asks for generation 1 while n, alive (lease held, store
    accepting), is still generating: m waits for it however many join windows pass, and both
    are in generation 1. (Before, m decided alone after one window and n was ejected.)"""
    q = quorums(etcd, "quorum-slow", "mn")
    first_generation(q, "mn")
    try:
        with ThreadPoolExecutor(2) as pool:
            m = pool.submit(q["m"].agree, 1)
            time.sleep(2.5)  # five join windows
            assert not m.done()
            n = pool.submit(q["n"].agree, 1)
            assert m.result().members == n.result().members == ("m", "n")
    finally:
        for x in q.values():
            x.close()


def test_a_killed_member_is_left_out_before_its_lease_lapses(etcd):
    """n's process is gone (its store port refuses) while its 30 s lease still holds: m decides
    generation 1 without it at once, not when the lease lapses."""
    q = quorums(etcd, "quorum-killed", "mn", lease_s=30)
    first_generation(q, "mn")
    try:
        port = int(q["n"].address.rpartition(":")[2])
        next(s for s in OPEN if s.getsockname()[1] == port).close()
        t0 = time.monotonic()
        assert q["m"].agree(1).members == ("m",)
        assert time.monotonic() - t0 < 5 and "n" in q["m"].members()  # the lease still holds
    finally:
        q["m"].close()
        q["n"]._stop.set()


def test_a_lapsed_lease_is_published_again_and_no_joiner_decides_alone(etcd):
    """m alone is generation 0. Its lease lapses (revoked from outside, as etcd does when it was
    away longer than the lease): m's record is published again within a renewal, so j, started
    under the job's name (as a relaunched replica would be), does not take the job for
    relaunched and decide generation 1 alone; it waits, and m takes it in. (Before, the record
    stayed gone and j decided alone: two jobs training the same prompts.)"""
    q = quorums(etcd, "quorum-lapse", "mj", lease_s=3)
    q["m"].register()
    assert q["m"].agree(0, expected=1).members == ("m",)
    try:
        q["m"]._lease.revoke()
        assert "m" not in q["m"].members()
        deadline = time.monotonic() + 3
        while "m" not in q["m"].members() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert q["m"].members().get("m") == q["m"].address
        q["j"].register()
        with ThreadPoolExecutor(2) as pool:
            j = pool.submit(q["j"].agree, 1)
            time.sleep(2.0)
            assert not j.done()
            m = pool.submit(q["m"].agree, 1)
            assert j.result().members == m.result().members == ("m", "j")
    finally:
        for x in q.values():
            x.close()


def _proxy(target: int) -> tuple[socket.socket, threading.Event]:
    """A TCP forwarder to ``target`` on loopback, closed (with every connection) when the event is set."""
    server, stop = socket.create_server(("127.0.0.1", 0)), threading.Event()
    conns: list[socket.socket] = []

    def pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                a, _ = server.accept()
            except TimeoutError:
                continue
            b = socket.create_connection(("127.0.0.1", target))
            conns.extend([a, b])
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=pipe, args=(x, y), daemon=True).start()
        server.close()
        for c in conns:
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return server, stop


def test_leases_survive_losing_the_endpoint_they_were_granted_through(etcd):
    """The lease is granted through the first endpoint (a forwarder to etcd), which then goes
    away: its refreshes fail over to the second endpoint, and the member record lives on.
    (Before, a lease was tied to the client that granted it: every refresh failed for good.)"""
    port = int(etcd.endpoint.rpartition(":")[2])
    server, stop = _proxy(port)
    store = MetadataStore([f"127.0.0.1:{server.getsockname()[1]}", etcd.endpoint], job="quorum-failover", retry_s=10)
    q = Quorum(store, "m", f"127.0.0.1:{listening().getsockname()[1]}", lease_s=2)
    q.register()
    try:
        stop.set()
        time.sleep(4.5)  # more than two leases
        assert q._lease.refresh() > 0
        assert MetadataStore([etcd.endpoint], job="quorum-failover").get_prefix("/quorum-failover/elastic/members/")
    finally:
        q.close()


def test_a_generation_takes_no_more_replicas_than_units_and_a_spare_waits(etcd):
    """With a unit of each mini-batch per replica and two units, generation 1 of {m, n} and a
    joiner a is {m, n}: a is told it is not a member (it waits as a spare) instead of being
    healed into a deal with nothing left for it (before: healed, then a crash in ``_units``)."""
    q = quorums(etcd, "quorum-full", "mna", max_members=2)
    first_generation(q, "mn")
    q["a"].register()
    try:
        with ThreadPoolExecutor(3) as pool:
            a = pool.submit(q["a"].agree, 1)
            gens = [f.result() for f in [pool.submit(q[n].agree, 1) for n in "mn"]]
            assert {g.members for g in gens} == {("m", "n")}
            with pytest.raises(NotAMember):
                a.result(timeout=10)
    finally:
        for x in q.values():
            x.close()
