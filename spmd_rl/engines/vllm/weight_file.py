"""A safetensors file written one tensor at a time (how a generator hands published weights to
its vLLM engine process, ``engines.vllm.engine``).

``safetensors.torch.save_file`` needs every tensor in memory at once: for a 32B model that is
the whole model on the generator's host. The header only needs each tensor's name, dtype and
shape, which the weight broadcast announces before any bytes (``reshard.broadcast``), so the
file is written header first and each tensor's bytes as they arrive. Peak host memory: one
broadcast bucket plus one tensor.

Format (the safetensors spec): an 8-byte little-endian header length N, N bytes of UTF-8 JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` padded with spaces to a multiple
of 8, then the tensors' bytes back to back in header order. Invariant (tested):
``safetensors.torch.load_file`` reads back the same tensors, bit for bit.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import torch

CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def header(meta: list[tuple[str, torch.dtype, list[int]]]) -> bytes:
    """Length prefix plus the padded JSON header of tensors laid out in ``meta`` order."""
    entries, at = {}, 0
    for name, dtype, shape in meta:
        if dtype not in CODES:
            raise ValueError(
                f"weight {name}: dtype {dtype} has no safetensors code here (known: {sorted(map(str, CODES))})"
            )
        n = dtype.itemsize * int(torch.Size(shape).numel())
        entries[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write(
    path: str, meta: list[tuple[str, torch.dtype, list[int]]], tensors: Iterator[tuple[str, torch.Tensor]]
) -> int:
    """Write ``tensors`` (consumed lazily, in ``meta`` order) to ``path``; returns how many.
    A tensor that does not match its header entry is refused before its bytes are written."""
    count = 0
    with open(path, "wb") as f:
        f.write(header(meta))
        for (name, dtype, shape), (got, t) in zip(meta, tensors, strict=True):
            if got != name or t.dtype != dtype or list(t.shape) != list(shape):
                raise ValueError(
                    f"weight {count} is {got} {t.dtype} {list(t.shape)}, the header announced {name} {dtype} "
                    f"{list(shape)}"
                )
            f.write(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)
            count += 1
    return count
