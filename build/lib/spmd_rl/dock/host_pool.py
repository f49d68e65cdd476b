"""Reused host buffers for the dock's copies (the in-process path's puts and gets).

Every iteration a rank copies the same amount of sample data into fresh flat buffers. A fresh
block from malloc is a new mapping: each 4 KiB page costs a minor fault plus kernel zeroing,
about 7x the copy itself (a 20 MiB ``torch.cat``: 14 ms fresh, 2 ms into warm pages, measured
on this project's CPU machine). The pool keeps freed buffers mapped and hands them out again.

A buffer is an anonymous ``mmap`` region wrapped as a tensor (numpy array -> ``torch.from_numpy``);
it returns to the pool when the last tensor that views it is freed (a ``weakref.finalize`` on
the array the tensor's storage keeps alive), in whatever thread that happens. Sizes are rounded
up to one of 8 classes per power of two (at most 12.5 % slack).

With ``memfd_name`` every buffer is a ``memfd`` instead (``region``): a file with no name in
any file system, which a same-node warehouse opens through ``/proc/<pid>/fd/<fd>`` to read or
write it (``dock.shm``); the fd closes, and the memory goes, with the last view of the buffer,
so a killed rank leaves nothing behind in ``/dev/shm``.

Invariants (``tests/integration/test_host_pool.py``): a buffer is never handed out while a tensor of it
is alive; a freed buffer of the same size class is reused (no new page faults); the idle
bytes the pool keeps never exceed ``max_idle_bytes`` (0: nothing is kept, every buffer is
fresh); blocks under ``min_bytes`` come from torch's allocator as before (never for a memfd pool).
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 1/8 of its power of two (4 KiB at least)."""
    nbytes = max(nbytes, 4096)
    step = 1 << max(nbytes.bit_length() - 4, 12)
    return -(-nbytes // step) * step


@dataclass(eq=False)
class Region:
    """One mapped buffer; ``fd`` and ``ino`` name its memfd (-1 and 0 when anonymous)."""

    mm: mmap.mmap
    fd: int = -1
    ino: int = 0


def _map(nbytes: int, memfd_name: str | None) -> Region:
    if memfd_name is None:
        return Region(mmap.mmap(-1, nbytes))
    fd = os.memfd_create(memfd_name, os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    region = Region(mmap.mmap(fd, nbytes), fd, os.fstat(fd).st_ino)
    weakref.finalize(region, os.close, fd)
    return region


class HostPool:
    def __init__(self, max_idle_bytes: int, min_bytes: int = 1 << 20, memfd_name: str | None = None):
        self.max_idle_bytes = max_idle_bytes
        self.memfd_name = memfd_name
        self.min_bytes = 0 if memfd_name else min_bytes
        self._free: dict[int, list[Region]] = {}
        self._idle = 0
        self._lock = threading.RLock()  # a finalizer may run in a thread that already holds it (GC)
        self.reused = 0
        self.mapped = 0

    @property
    def idle_bytes(self) -> int:
        return self._idle

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D uninitialised tensor of ``numel`` elements, from the pool when it is big enough."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if self.memfd_name is None and (nbytes < self.min_bytes or self.max_idle_bytes == 0):
            return torch.empty(numel, dtype=dtype)
        return self.region(nbytes)[0].view(dtype)

    def region(self, nbytes: int) -> tuple[torch.Tensor, Region]:
        """(An uninitialised uint8 tensor of ``nbytes`` at offset 0 of a pooled buffer, that
        buffer); the buffer returns to the pool when the last tensor viewing it is freed."""
        cls = size_class(nbytes)
        with self._lock:
            free = self._free.get(cls)
            region = free.pop() if free else None
            if region is not None:
                self._idle -= cls
                self.reused += 1
            else:
                self.mapped += 1
        if region is None:
            region = _map(cls, self.memfd_name)
        arr = np.frombuffer(region.mm, dtype=np.uint8, count=nbytes)
        weakref.finalize(arr, self._release, region, cls)
        return torch.from_numpy(arr), region

    def _release(self, region: Region, cls: int) -> None:
        """Back to the free list, unless that would exceed the idle bound (then it is unmapped
        once the array's buffer export is released, right after this call)."""
        with self._lock:
            if self._idle + cls <= self.max_idle_bytes:
                self._free.setdefault(cls, []).append(region)
                self._idle += cls
