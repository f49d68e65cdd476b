"""One interface over cpu (gloo), cuda (nccl) and npu (hccl, via torch_npu when importable):
device, process-group backend, pinned host memory, synchronize, memory statistics.

No other module calls ``torch.cuda`` or ``torch.npu``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl", "npu": "cpu:gloo,npu:hccl"}
"""Process-group backend per device kind. Off CPU the group serves both host tensors (gloo:
metrics, token counts, dynamic-sampling rewards) and device tensors (nccl / hccl), so no
collective on a CPU tensor can meet a backend without CPU support."""


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401

    return torch.npu.is_available()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Accelerator:
    kind: str
    local_rank: int = 0

    @property
    def backend(self) -> str:
        return BACKENDS[self.kind]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, self.local_rank)

    @property
    def host_is_device(self) -> bool:
        """On CPU the "device" and the host are the same memory: swaps copy, they save nothing."""
        return self.kind == "cpu"

    def set_device(self) -> None:
        if self.kind != "cpu":
            getattr(torch, self.kind).set_device(self.local_rank)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer, pinned when a device exists (fast, async-capable copies)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=not self.host_is_device)

    def empty_cache(self) -> None:
        """Return freed device blocks to the driver (no-op on CPU)."""
        if self.kind != "cpu":
            getattr(torch, self.kind).empty_cache()

    def synchronize(self) -> None:
        if self.kind != "cpu":
            getattr(torch, self.kind).synchronize()

    def device_used_bytes(self) -> int | None:
        """Bytes in use on the device now, by every allocator of the process and by other
        processes: total - free from the driver (``mem_get_info``). torch's own allocator
        statistics miss vLLM's weights and KV cache, which live in its cumem pool. None on CPU
        (use the ledger)."""
        if self.kind == "cpu":
            return None
        free, total = getattr(torch, self.kind).mem_get_info(self.device)
        return int(total - free)

    def allocated_bytes(self) -> int | None:
        """Bytes this process's torch allocator holds in tensors now (``memory_allocated``): the
        training state, not vLLM's cumem pool nor the pools and contexts that make the driver's
        count differ from process to process. None on CPU."""
        return None if self.kind == "cpu" else int(getattr(torch, self.kind).memory_allocated(self.device))

    def device_free_bytes(self) -> int | None:
        """Free device bytes from the driver; None on CPU."""
        return None if self.kind == "cpu" else int(getattr(torch, self.kind).mem_get_info(self.device)[0])

    def max_memory_allocated(self) -> int | None:
        return None if self.kind == "cpu" else int(getattr(torch, self.kind).max_memory_allocated(self.device))

    def reset_peak_memory_stats(self) -> None:
        if self.kind != "cpu":
            getattr(torch, self.kind).reset_peak_memory_stats(self.device)


def detect(kind: str = "auto", local_rank: int | None = None) -> Accelerator:
    """``auto`` picks npu, then cuda, then cpu."""
    lr = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
    if kind == "auto":
        kind = "npu" if _npu_available() else "cuda" if torch.cuda.is_available() else "cpu"
    if kind not in BACKENDS:
        raise ValueError(f"unknown accelerator {kind!r}; use cpu, cuda or npu")
    if kind == "cuda" and not torch.cuda.is_available() or kind == "npu" and not _npu_available():
        raise ValueError(
            f"trainer.device={kind}: no {kind.upper()} device is visible to this process -> use auto or cpu, "
            f"or install the matching torch build (the `{kind}` extra)"
        )
    return Accelerator(kind, lr)
