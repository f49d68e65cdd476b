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
