"""Memory measured from outside the code under test: live tensor bytes and collective calls
in a region (``LiveBytes``), and the kernel's RSS counters (``status_kib``, ``reset_peak_rss``).

``LiveBytes`` is a ``TorchDispatchMode``: every op's output storage that it has not seen is
added to ``live`` (and ``peak``) and subtracted when the storage is freed (``weakref.finalize``
on the storage, which PyTorch keeps alive exactly as long as its data). An output that shares
an input's storage (a view, an in-place op) allocated nothing, so storages made before the
region are not counted when a view of them first passes through. It sees what torch
allocates on any device, CPU included, where there are no allocator statistics. Ops whose name
holds ``all_gather`` or ``allgather`` are counted in ``collectives``.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[int] = set()
        self.live = self.peak = self.collectives = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "all_gather" in name or "allgather" in name:
            self.collectives += 1
        out = func(*args, **(kwargs or {}))
        inputs = {_ptr(t) for t in tree_flatten((args, kwargs))[0]}
        for t in tree_flatten(out)[0]:
            if type(t) is torch.Tensor:  # a wrapper subclass's data is its inner tensor's, seen where it was made
                storage = t.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
                if n and key not in self.seen and key not in inputs:  # a view or an in-place op allocates nothing
                    self.seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, n)
        return out

    def _freed(self, key: int, n: int) -> None:
        self.seen.discard(key)
        self.live -= n


def _ptr(t) -> int | None:
    return t.untyped_storage().data_ptr() if type(t) is torch.Tensor else None


def status_kib(field: str) -> int:
    """A /proc/self/status counter in KiB: VmRSS (resident now) or VmHWM (peak resident)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS and return it, in KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_kib("VmRSS")
