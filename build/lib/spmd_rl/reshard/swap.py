"""Device <-> host swap of a set of tensors at storage level, bit-exact.

Each distinct storage behind the given tensors (FSDP2 shards are views into padded flat
buffers) is copied byte for byte into its slice of one host arena that is allocated once per
swap set and reused (one pinned allocation: torch's pinned host allocator rounds each
allocation up to a power of two, so a buffer per storage cost up to 2x the bytes), then
the device storage is resized to 0, which releases it; ``reload`` resizes it back and copies
the bytes in. Views keep referring to the same storage object, so parameters, gradients and
optimizer states are intact after the round trip.

Where host and device are the same memory (CPU), one copy of a small storage runs on one
thread, so the storages are split into ``threads`` groups of about equal bytes copied in
parallel (a copy releases the GIL); a device copy is asynchronous on its stream already and
runs in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from spmd_rl.distributed.accelerator import Accelerator


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def balanced_groups(sizes: list[int], k: int) -> list[list[int]]:
    """Indices of ``sizes`` in ``k`` groups of about equal total (largest first, each to the
    lightest group so far)."""
    groups: list[list[int]] = [[] for _ in range(max(1, k))]
    totals = [0] * len(groups)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        g = totals.index(min(totals))
        groups[g].append(i)
        totals[g] += sizes[i]
    return [g for g in groups if g]


class HostSwap:
    def __init__(self, acc: Accelerator, threads: int | None = None):
        """``threads``: parallel copies on CPU (default: torch's intra-op thread count)."""
        self.acc = acc
        self.threads = 1 if not acc.host_is_device else (threads or torch.get_num_threads())
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="host-swap") if self.threads > 1 else None
        self._storages: list[torch.UntypedStorage] = []
        self._sizes: list[int] = []
        self._host: list[torch.Tensor] = []
        self.offloaded = False

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """(Re)define the tensors to swap; host buffers are kept when the sizes match."""
        seen: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr() not in seen:
                seen[s.data_ptr()] = s
        storages = list(seen.values())
        sizes = [s.nbytes() for s in storages]
        if sizes != self._sizes:
            arena = self.acc.host_empty(sum(sizes))
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            self._host = [arena[o : o + n] for o, n in zip(offsets, sizes)]
        self._storages, self._sizes = storages, sizes

    @property
    def nbytes(self) -> int:
        return sum(self._sizes)

    def _each(self, copy) -> None:
        """``copy(i)`` for every storage, in balanced parallel groups on CPU."""
        if self._pool is None:
            for i in range(len(self._storages)):
                copy(i)
            return
        work = [self._pool.submit(lambda g=g: [copy(i) for i in g]) for g in balanced_groups(self._sizes, self.threads)]
        for w in work:
            w.result()

    def offload(self) -> None:
        """Device -> host, then release the device storage."""
        if self.offloaded:
            return
        self._each(
            lambda i: self._host[i].copy_(_bytes_view(self._storages[i]), non_blocking=not self.acc.host_is_device)
        )
        self.acc.synchronize()
        for s in self._storages:
            s.resize_(0)
        self.offloaded = True

    def reload(self) -> None:
        """Host -> device into freshly allocated storage of the original size."""
        if not self.offloaded:
            return

        def copy(i: int) -> None:
            self._storages[i].resize_(self._sizes[i])
            _bytes_view(self._storages[i]).copy_(self._host[i], non_blocking=not self.acc.host_is_device)

        self._each(copy)
        self.acc.synchronize()
        self.offloaded = False


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` that are allocated now."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
