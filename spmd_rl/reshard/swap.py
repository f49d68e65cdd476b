"""Device <-> host swap of a set of tensors at storage level, bit-exact.

Each distinct storage behind the given tensors (FSDP2 shards are views into padded flat
buffers) is copied byte for byte into a host buffer that is allocated once and reused, then
the device storage is resized to 0, which releases it; ``reload`` resizes it back and copies
the bytes in. Views keep referring to the same storage object, so parameters, gradients and
optimizer states are intact after the round trip.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from spmd_rl.distributed.accelerator import Accelerator


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostSwap:
    def __init__(self, acc: Accelerator):
        self.acc = acc
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
            self._host = [self.acc.host_empty(n) for n in sizes]
        self._storages, self._sizes = storages, sizes

    @property
    def nbytes(self) -> int:
        return sum(self._sizes)

    def offload(self) -> None:
        """Device -> host, then release the device storage."""
        if self.offloaded:
            return
        for s, h in zip(self._storages, self._host):
            h.copy_(_bytes_view(s), non_blocking=not self.acc.host_is_device)
        self.acc.synchronize()
        for s in self._storages:
            s.resize_(0)
        self.offloaded = True

    def reload(self) -> None:
        """Host -> device into freshly allocated storage of the original size."""
        if not self.offloaded:
            return
        for s, n, h in zip(self._storages, self._sizes, self._host):
            s.resize_(n)
            _bytes_view(s).copy_(h, non_blocking=not self.acc.host_is_device)
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
