"""A safetensors file written one tensor at a time, so a writer holds one tensor, not the file.

The format (https://github.com/huggingface/safetensors, "Format"): 8 bytes, the little-endian
length N of a JSON header; the header, ``{name: {"dtype", "shape", "data_offsets": [begin,
end]}, "__metadata__": {...}}`` with offsets relative to the byte after it, padded with spaces
so the data starts 8-byte aligned; then each tensor's bytes, row-major, little-endian, in
header order. Every offset is known from the shapes and the dtype before any tensor is, so the
header goes first and each tensor is appended as it arrives.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class SafetensorsWriter:
    """``entries``: (name, shape) in the order ``write`` will be called, all of ``dtype``."""

    def __init__(self, path: str | Path, entries: list[tuple[str, list[int]]], dtype: torch.dtype, metadata: dict):
        self.dtype, self.order, self.next = dtype, entries, 0
        size, header, begin = torch.tensor([], dtype=dtype).element_size(), {"__metadata__": metadata}, 0
        for name, shape in entries:
            end = begin + size * int(torch.Size(shape).numel())
            header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [begin, end]}
            begin = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close)
        self.file.write(struct.pack("<Q", len(text)) + text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, shape = self.order[self.next]
        if name != want or list(tensor.shape) != list(shape) or tensor.dtype != self.dtype:
            raise ValueError(f"tensor {name} {list(tensor.shape)} {tensor.dtype}: the header expects {want} {shape}")
        self.file.write(tensor.contiguous().view(torch.uint8).numpy())  # its buffer: no copy
        self.next += 1

    def close(self) -> None:
        self.file.close()
        if self.next != len(self.order):
            raise ValueError(f"{self.file.name}: {len(self.order) - self.next} tensors of its header never written")
