"""The metadata store against a real etcd process: operations, lease expiry, watch, CAS,
retry-then-fail when etcd is gone, and no orphaned etcd when its owner is killed."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from spmd_rl.dock.errors import DockUnavailable
from spmd_rl.dock.etcd_server import EmbeddedEtcd, pid_alive
from spmd_rl.dock.metadata import MetadataStore
from tests.conftest import subprocess_env


def test_operations(etcd):
    m = MetadataStore([etcd.endpoint], job="meta-ops")
    m.put(m.key(3, "puts", "a"), b"1")
    m.put(m.key(3, "puts", "b"), b"2")
    m.put(m.key(4, "puts", "c"), b"3")
    assert m.get(m.key(3, "puts", "a")) == b"1" and m.get(m.key(9)) is None
    assert m.get_prefix(m.key(3) + "/") == [("/meta-ops/3/puts/a", b"1"), ("/meta-ops/3/puts/b", b"2")]
    assert m.create(m.key("x"), b"first") and not m.create(m.key("x"), b"second")
    assert not m.replace(m.key("x"), b"wrong", b"new") and m.replace(m.key("x"), b"first", b"new")
    assert m.get(m.key("x")) == b"new"
    m.delete_prefix(m.key(3) + "/")
    assert m.get_prefix(m.key(3) + "/") == [] and m.get(m.key(4, "puts", "c")) == b"3"


def test_lease_expires(etcd):
    m = MetadataStore([etcd.endpoint], job="meta-lease")
    m.put(m.key("alive"), b"1", ttl_s=1)
    assert m.get(m.key("alive")) == b"1"
    deadline = time.monotonic() + 10
    while m.get(m.key("alive")) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert m.get(m.key("alive")) is None


def test_watch_sees_put(etcd):
    m = MetadataStore([etcd.endpoint], job="meta-watch")
    events, cancel = m.watch_prefix(m.key("w") + "/")
    seen = []

    def read():
        for ev in events:
            seen.append(ev)
            break

    t = threading.Thread(target=read, daemon=True)
    t.start()
    # the watch may not be established yet when the first put lands: put again until the
    # reader has an event (waits on the event, not on a guessed sleep)
    deadline = time.monotonic() + 30
    k = 0
    while t.is_alive() and time.monotonic() < deadline:
        m.put(m.key("w", f"k{k}"), b"v")
        k += 1
        t.join(timeout=0.2)
    cancel()
    assert seen and seen[0]["kv"]["key"].startswith(b"/meta-watch/w/k") and seen[0]["kv"]["value"] == b"v"


def test_a_puts_only_watch_gets_no_deletes(etcd):
    """The record feed's watch (``puts_only``): from a revision, every put and no delete,
    in order; the plain watch of the same range gets the deletes too."""
    m = MetadataStore([etcd.endpoint], job="meta-puts-only")
    revision, _ = m.get_prefix_at(m.key("w") + "/")
    for k in range(3):
        m.put(m.key("w", k), b"v")
    m.delete_prefix(m.key("w") + "/")
    m.put(m.key("w", "last"), b"v")
    got = {}
    for puts_only in (True, False):
        events, cancel = m.watch_prefix(m.key("w") + "/", start_revision=revision + 1, puts_only=puts_only)
        seen = []
        for ev in events:  # replayed from the revision: no race with the puts above
            seen.append((ev.get("type", "PUT"), ev["kv"]["key"].decode().rsplit("/", 1)[1]))
            if seen[-1][1] == "last":
                break
        cancel()
        got[puts_only] = seen
    assert got[True] == [("PUT", "0"), ("PUT", "1"), ("PUT", "2"), ("PUT", "last")]
    assert [t for t, _ in got[False]].count("DELETE") == 3


def test_lost_etcd_retries_then_fails():
    e = EmbeddedEtcd().start()
    m = MetadataStore([e.endpoint], job="meta-lost", retry_s=1.0, timeout_s=0.5)
    m.put(m.key("a"), b"1")
    e.stop()
    t0 = time.monotonic()
    with pytest.raises(DockUnavailable, match="unreachable for 1s"):  # gave up after metadata.retry_s
        m.get(m.key("a"))
    print(f"gave up after {time.monotonic() - t0:.1f} s")


def test_embedded_etcd_dies_with_killed_owner(tmp_path):
    code = (
        "import sys, time\n"
        "from spmd_rl.dock.etcd_server import EmbeddedEtcd\n"
        "e = EmbeddedEtcd().start()\n"
        "print(e.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=subprocess_env())
    etcd_pid = int(owner.stdout.readline())
    assert pid_alive(etcd_pid)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 10
    while pid_alive(etcd_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    # reaped by init or still a zombie for a moment: either way not serving
    assert not pid_alive(etcd_pid) or open(f"/proc/{etcd_pid}/stat").read().split()[2] == "Z"


def test_a_watch_ends_with_its_etcd_and_the_feed_catches_up_after_a_restart(tmp_path):
    """etcd3gw's own watch iterator blocks for ever once its stream closes, so a feed kept
    ``watching`` a dead connection and no wait re-read etcd after a restart (the run hung in
    test_etcd_restart). The stream's end must end the iteration; a resync then sees the
    records put since."""
    from spmd_rl.dock.feed import RecordFeed
    from spmd_rl.dock.records import PutRecord

    etcd = EmbeddedEtcd(data_dir=str(tmp_path)).start()
    port = etcd.client_port
    m = MetadataStore([etcd.endpoint], job="meta-restart", retry_s=30.0)
    put = lambda name, idx: m.put(m.key(0, "puts", name), PutRecord("gen", 0, 0, ["x"], [idx]).encode())  # noqa: E731
    put("a", 0)
    feed = RecordFeed(m, 0)
    try:
        put("b", 1)
        assert feed.wait_change(feed.version, 10) or feed.ready(["x"], [0, 1])
        assert feed.ready(["x"], [0, 1]) and feed.watching
        etcd.stop()
        deadline = time.monotonic() + 10
        while feed.watching and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not feed.watching, "the feed's watch outlived its etcd"
        etcd = EmbeddedEtcd(client_port=port, data_dir=str(tmp_path)).start()
        put("c", 2)
        feed.resync()
        assert feed.ready(["x"], [0, 1, 2]) and feed.watching
        put("d", 3)
        deadline = time.monotonic() + 10
        while not feed.ready(["x"], [0, 1, 2, 3]) and time.monotonic() < deadline:
            feed.wait_change(feed.version, 0.2)
        assert feed.ready(["x"], [0, 1, 2, 3])  # the new watch follows the restarted etcd
    finally:
        feed.stop()
        etcd.stop()


def test_cancel_wakes_a_reader_blocked_in_the_stream(etcd):
    m = MetadataStore([etcd.endpoint], job="meta-cancel")
    events, cancel = m.watch_prefix(m.key("w") + "/")
    ended = threading.Event()
    t = threading.Thread(target=lambda: (list(events), ended.set()), daemon=True)
    t.start()
    time.sleep(0.3)  # the reader is blocked in the socket: nothing was put
    assert not ended.is_set()
    cancel()
    assert ended.wait(5), "cancel did not end the iteration"
