"""The warehouse's side of the same-node path: payloads through the requesting rank's memory.

A rank on the warehouse's own node (not the one serving it: that one is in process,
``dock.local``) keeps its payload buffers in memfds (``HostPool(memfd_name=...)``). Its request
still travels on the wire and is authenticated as every request is; only the bytes move
differently: the warehouse reads a put from, and writes a get into, the rank's buffer with one
``preadv`` / ``pwritev`` each, so a payload never passes the socket, the MAC or a
serialization (64 MiB on loopback: 184 ms over the wire, ``tools/bench_same_node.py``).

Request fields (``shm``: ``{pid, fd, ino}``, the buffer as the rank's own fd):

- ``put``: ``columns: {name: {ragged, lengths?, dtype, shape, offset}}`` and no tensor frames;
  each column's bytes are read at ``offset``.
- ``get``: ``shm.capacity`` bytes are writable. A reply under ``SHM_MIN_BYTES`` comes inline as
  on the wire; one that does not fit answers ``{need}`` (the rank retries with a buffer that
  big); otherwise every column is written at a ``ALIGN``-aligned offset and the answer is
  ``{placed: {name: {ragged, lengths?, dtype, shape, offset}}}``.

Invariants (``tests/unit/test_dock_same_node.py``): the same data, byte counts (Eq. (4)) and
refusals as the wire. No request makes the warehouse touch other memory or stop: it opens the
file through ``/proc/<pid>/fd/<fd>`` and proceeds only when the file it opened is a memfd named
for this job's key (``memfd_name``), owned by this uid, of inode ``ino`` (a reused fd number is
not mistaken for the buffer) and long enough for every byte it moves; it never maps the file, so
a rank that shrinks its buffer cannot SIGBUS the server. Any failure is answered with a
``PeerMemoryError`` and the rank falls back to the wire for that warehouse.
"""

from __future__ import annotations

import hashlib
import os
import stat
from typing import Any

import torch

from spmd_rl.dock.errors import DockRequestError
from spmd_rl.dock.host_pool import HostPool
from spmd_rl.dock.store import WarehouseStore, unflatten
from spmd_rl.dock.wire import check_meta, dtype_name, tensor_bytes

SHM_MIN_BYTES = 64 << 10
"""Payloads smaller than this stay on the wire: one round trip, and the MAC of a few KiB is cheap."""
ALIGN = 64
IOV_BATCH = 512  # below IOV_MAX (1024) on Linux
MAX_OFFSET = 1 << 48


class PeerMemoryError(DockRequestError):
    """The warehouse cannot use the rank's buffer; the rank falls back to the wire."""


def memfd_name(key: bytes) -> str:
    """The name this job's memfds carry (visible as ``/memfd:<name>`` in ``/proc``): the
    warehouse moves bytes only through buffers of its own job."""
    return "spmd-rl-dock-" + hashlib.sha256(b"memfd" + key).hexdigest()[:16]


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """(Each size's offset, every size rounded up to ``ALIGN``, total)."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    return offsets, end


def _uint(x: Any, name: str, low: int = 0) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or not low <= x <= MAX_OFFSET:
        raise PeerMemoryError(f"shm.{name} must be an integer in [{low}, 2^48], got {str(x)[:40]}")
    return x


def open_peer_buffer(ref: Any, key: bytes, end: int, resident: int = 0) -> int:
    """An fd of the rank's buffer ``ref`` = {pid, fd, ino}, checked as the module says, at
    least ``end`` bytes long with ``resident`` of them in memory (a put's payload must really be
    there: a sparse file of any length costs the rank nothing); the caller closes it."""
    if not isinstance(ref, dict):
        raise PeerMemoryError("shm must be a map {pid, fd, ino}")
    pid, fd, ino = _uint(ref.get("pid"), "pid", 1), _uint(ref.get("fd"), "fd"), _uint(ref.get("ino"), "ino")
    path, ours = f"/proc/{pid}/fd/{fd}", f"/memfd:{memfd_name(key)} (deleted)"
    try:  # the name first, so nothing but this job's memfd is ever opened (opening a device can act)
        target = os.readlink(path)
        if target != ours:
            raise PeerMemoryError(f"fd {fd} of pid {pid} is {target[:80]!r}, not a memfd of this job")
        f = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise PeerMemoryError(
            f"cannot open fd {fd} of pid {pid} ({exc.strerror}): not a rank on this node, or /proc is closed to this "
            f"process"
        ) from None
    try:
        st, target = os.fstat(f), os.readlink(f"/proc/self/fd/{f}")  # what was opened, whatever the peer did since
        if target != ours or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PeerMemoryError(f"fd {fd} of pid {pid} is {target[:80]!r}, not a memfd of this job")
        if st.st_ino != ino:
            raise PeerMemoryError(f"fd {fd} of pid {pid} is inode {st.st_ino}, not the buffer {ino} the request names")
        if st.st_size < end or st.st_blocks * 512 < resident:
            raise PeerMemoryError(
                f"the buffer holds {st.st_size} bytes ({st.st_blocks * 512} in memory); the request needs {end} "
                f"({resident})"
            )
    except BaseException:
        os.close(f)
        raise
    return f


def _write(f: int, views: list[memoryview], offset: int) -> None:
    views = [v for v in views if v.nbytes]
    for a in range(0, len(views), IOV_BATCH):
        batch = views[a : a + IOV_BATCH]
        want = sum(v.nbytes for v in batch)
        if os.pwritev(f, batch, offset) != want:
            raise PeerMemoryError("short write into the rank's buffer")
        offset += want


def serve_get(
    store: WarehouseStore, key: bytes, it: int, indices: list[int], names: list[str], ref: Any
) -> dict | None:
    """The answer to a ``get`` carrying ``shm`` (see the module), or None: answer inline (a
    small reply, or a column whose samples differ in dtype or, when fixed, in shape)."""
    cols, ragged = store.get(it, indices, names)
    sizes = [sum(t.numel() * t.element_size() for t in cols[n]) for n in names]
    offsets, total = aligned_offsets(sizes)
    uniform = all(len({(t.dtype, () if ragged[n] else t.shape) for t in cols[n]}) == 1 for n in names)
    if total < SHM_MIN_BYTES or not uniform:
        return None
    if not isinstance(ref, dict):
        raise PeerMemoryError("shm must be a map {pid, fd, ino, capacity}")
    if _uint(ref.get("capacity"), "capacity") < total:
        return {"need": total}
    placed = {}
    f = open_peer_buffer(ref, key, total)
    try:
        for name, offset in zip(names, offsets):
            first = cols[name][0]
            _write(f, [tensor_bytes(t) for t in cols[name]], offset)
            shape = [sum(t.numel() for t in cols[name])] if ragged[name] else [len(indices), *first.shape]
            placed[name] = {"ragged": ragged[name], "offset": offset, "dtype": dtype_name(first.dtype), "shape": shape}
            if ragged[name]:
                placed[name]["lengths"] = [t.numel() for t in cols[name]]
    finally:
        os.close(f)
    store.count_out(it, sum(sizes))
    return {"placed": placed}


def put_columns(
    key: bytes, indices: list[int], specs: Any, ref: Any, max_message_bytes: int, pool: HostPool
) -> tuple[dict, dict]:
    """(Per-column per-sample tensors, ragged flags) of a ``put`` carrying ``shm``: every
    column is validated before one byte is read, each is read into a buffer of its own from
    ``pool`` (warm pages, once an earlier iteration's buffers were freed). The columns may not
    overlap in the rank's buffer and must be resident there, so the bytes the warehouse
    allocates are bytes the rank holds, as on the wire, where it must send them."""
    if not isinstance(specs, dict) or not specs:
        raise DockRequestError("put columns must map names to {ragged, lengths?, dtype, shape, offset}")
    parsed = []
    for name, spec in specs.items():
        if not isinstance(name, str) or not isinstance(spec, dict) or not isinstance(spec.get("ragged"), bool):
            raise DockRequestError(f"put column {str(name)[:40]!r}: needs {{ragged: bool, dtype, shape, offset}}")
        dtype, shape, nbytes = check_meta(spec)
        if nbytes > max_message_bytes:
            raise DockRequestError(f"a put column of {nbytes} bytes exceeds dock.max_message_bytes={max_message_bytes}")
        lengths = spec.get("lengths") if spec["ragged"] else None
        if spec["ragged"] and not (
            isinstance(lengths, list)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths)
        ):
            raise DockRequestError(f"ragged put column {name!r} needs lengths: [int]")
        parsed.append((name, dtype, shape, nbytes, _uint(spec.get("offset"), "offset"), lengths))
    spans = sorted((offset, offset + nbytes) for *_, nbytes, offset, _ in parsed)
    if any(a < b for (_, b), (a, _) in zip(spans, spans[1:])):
        raise DockRequestError("put columns overlap in the buffer")
    f = open_peer_buffer(ref, key, spans[-1][1], sum(b - a for a, b in spans))
    cols = {}
    try:
        for name, dtype, shape, nbytes, offset, lengths in parsed:
            buf = pool.empty(nbytes, torch.uint8)
            if nbytes and os.preadv(f, [tensor_bytes(buf)], offset) != nbytes:
                raise PeerMemoryError(f"short read of column {name!r} from the rank's buffer")
            cols[name] = unflatten(buf.view(dtype).reshape(shape), len(indices), lengths)
    finally:
        os.close(f)
    return cols, {name: spec["ragged"] for name, spec in specs.items()}
