"""A node's presence board: one 8-byte slot per local rank holding the ``CLOCK_MONOTONIC``
second of that rank's last beat, in a memfd its node's lead (local rank 0) creates.

The node's other ranks open the lead's memfd through ``/proc/<pid>/fd/<fd>`` (as ``dock.shm``
opens a rank's buffer) and write their own slot with one ``pwrite`` a second; the lead reads
every slot with one ``pread``. ``CLOCK_MONOTONIC`` is one clock for every process of a host, so
an age is the same whoever reads it. A slot that was never written holds 0.0: the rank has not
started (its age is infinite, and ``dock.node_lease`` neither puts nor withdraws its key).

Nothing here is mapped (a peer that shrinks the file cannot SIGBUS the reader) and nothing
read is interpreted beyond a float. An open checks the file's inode, owner and size, so a reused
pid or fd never makes a rank beat on another file.
"""

from __future__ import annotations

import os
import stat
import struct
import time

SLOT = struct.Struct("<d")


class PresenceUnavailable(OSError):
    """The lead's board cannot be opened from this process (another pid namespace, a lead that
    is gone, a record that names another file)."""


class PresenceBoard:
    def __init__(self, fd: int, slots: int):
        self.fd = fd
        self.slots = slots

    @classmethod
    def create(cls, slots: int, name: str = "spmd-rl-presence") -> "PresenceBoard":
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, slots * SLOT.size)  # zero-filled: no rank has beaten yet
        return cls(fd, slots)

    def ref(self) -> dict:
        """What another process of this host needs to open the board."""
        return {"pid": os.getpid(), "fd": self.fd, "ino": os.fstat(self.fd).st_ino, "slots": self.slots}

    @classmethod
    def open(cls, ref: dict) -> "PresenceBoard":
        """The board ``ref`` names, opened for writing; PresenceUnavailable when the file at
        that place is not it (wrong inode or owner, too short) or cannot be opened."""
        path = f"/proc/{int(ref['pid'])}/fd/{int(ref['fd'])}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise PresenceUnavailable(f"cannot open the node's presence board at {path}: {exc}") from exc
        st = os.fstat(fd)
        slots = int(ref["slots"])
        if (
            st.st_ino != int(ref["ino"])
            or st.st_uid != os.getuid()
            or not stat.S_ISREG(st.st_mode)
            or st.st_size < slots * SLOT.size
        ):
            os.close(fd)
            raise PresenceUnavailable(f"{path} is not the node's presence board (inode, owner or size differ)")
        return cls(fd, slots)

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
