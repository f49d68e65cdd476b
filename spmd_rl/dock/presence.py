"""A node's presence board: one 8-byte slot per local rank holding the ``CLOCK_MONOTONIC``
second of that rank's last beat, in a memfd its node's lead (local rank 0) creates.

The node's other ranks open the lead's memfd through ``/proc/<pid>/fd/<fd>`` (as ``dock.shm``
opens a rank's buffer) and write their own slot with one ``pwrite`` a second; the lead reads
every slot with one ``pread``. ``CLOCK_MONOTONIC`` is one clock for every process of a host, so
an age is the same whoever reads it. A slot that was never written holds 0.0: the rank has not
started (its age is infinite, and ``dock.node_lease`` neither puts nor withdraws its key).

Nothing here is mapped (a peer that shrinks the file cannot SIGBUS the reader) and nothing
read is interpreted beyond a float. The record that names the board comes from etcd, so an
open trusts none of it: it reads the link first and opens only a memfd named for this job's
key (``presence_name``; never a FIFO or a device, whose open can block or act, nor any other
file a process of this user holds open), then checks what it opened: the same name, a regular
file of this user, the record's inode, long enough for its slots. A writer of etcd without the
job's token can at most point a rank at another board of the same job.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import time

SLOT = struct.Struct("<d")


def presence_name(key: bytes) -> str:
    """The name this job's boards carry (``/memfd:<name>`` in ``/proc``), from its job key."""
    return "spmd-rl-presence-" + hashlib.sha256(b"presence" + key).hexdigest()[:16]


class PresenceUnavailable(OSError):
    """The lead's board cannot be opened from this process (another pid namespace, a lead that
    is gone, a record that names another file)."""


class PresenceBoard:
    def __init__(self, fd: int, slots: int):
        self.fd = fd
        self.slots = slots

    @classmethod
    def create(cls, slots: int, name: str) -> "PresenceBoard":
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, slots * SLOT.size)  # zero-filled: no rank has beaten yet
        return cls(fd, slots)

    def ref(self) -> dict:
        """What another process of this host needs to open the board."""
        return {"pid": os.getpid(), "fd": self.fd, "ino": os.fstat(self.fd).st_ino, "slots": self.slots}

    @classmethod
    def open(cls, ref: dict, name: str) -> "PresenceBoard":
        """The board ``ref`` names, opened for writing, if it is a memfd called ``name``;
        PresenceUnavailable when the file at that place is anything else or cannot be opened."""
        try:
            pid, fd, ino, slots = (int(ref[k]) for k in ("pid", "fd", "ino", "slots"))
        except (KeyError, TypeError, ValueError) as exc:
            raise PresenceUnavailable(f"the presence record {ref!r} lacks pid, fd, ino or slots") from exc
        path, ours = f"/proc/{pid}/fd/{fd}", f"/memfd:{name} (deleted)"
        try:
            if (target := os.readlink(path)) != ours:  # before the open: nothing else is ever opened
                raise PresenceUnavailable(f"{path} is {target[:80]!r}, not this job's presence board")
            f = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError as exc:
            raise PresenceUnavailable(f"cannot open the node's presence board at {path}: {exc}") from exc
        st, target = os.fstat(f), os.readlink(f"/proc/self/fd/{f}")  # what was opened, whatever changed since
        if (
            target != ours
            or not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.geteuid()
            or st.st_ino != ino
            or not 0 < slots <= 4096
            or st.st_size < slots * SLOT.size
        ):
            os.close(f)
            raise PresenceUnavailable(f"{path} is not the node's presence board (name, inode, owner or size differ)")
        return cls(f, slots)

    def beat(self, slot: int, now: float | None = None) -> None:
        os.pwrite(self.fd, SLOT.pack(time.monotonic() if now is None else now), slot * SLOT.size)

    def ages(self, now: float | None = None) -> list[float]:
        """Seconds since each slot's last beat; ``inf`` for a slot never written."""
        now = time.monotonic() if now is None else now
        raw = os.pread(self.fd, self.slots * SLOT.size, 0).ljust(self.slots * SLOT.size, b"\0")
        beats = [SLOT.unpack_from(raw, i * SLOT.size)[0] for i in range(self.slots)]
        return [float("inf") if b == 0.0 else now - b for b in beats]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
