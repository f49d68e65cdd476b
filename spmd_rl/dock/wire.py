"""Wire format of the dock: one msgpack header frame followed by raw tensor buffers.

Never pickle: a header is msgpack of plain maps/lists/str/int/float/bool, and tensors travel as
their bytes with (dtype, shape) in the header. Only the dtypes in ``DTYPES`` are accepted, so a
peer cannot make the receiver build arbitrary objects.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import torch

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 64 << 20


class WireError(ValueError):
    pass


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} cannot be sent; use one of {', '.join(DTYPES)}") from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (contiguous copy only when needed)."""
    flat = t.detach().contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def tensor_meta(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}


def encode(header: dict[str, Any], tensors: list[torch.Tensor]) -> list[Any]:
    """Frames: msgpack(header + tensor metas), then one buffer per tensor."""
    head = dict(header, tensors=[tensor_meta(t) for t in tensors])
    return [msgpack.packb(head, use_bin_type=True)] + [tensor_bytes(t) for t in tensors]


def decode_header(frame: bytes) -> dict[str, Any]:
    if len(frame) > MAX_HEADER_BYTES:
        raise WireError("header too large")
    try:
        head = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"malformed header: {exc}") from None
    if not isinstance(head, dict):
        raise WireError("header is not a map")
    return head


def decode(frames: list[bytes | memoryview]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Inverse of :func:`encode`; validates dtypes, shapes and byte counts, copies each buffer once."""
    head = decode_header(bytes(frames[0]))
    metas = head.pop("tensors", [])
    if not isinstance(metas, list) or len(metas) != len(frames) - 1:
        raise WireError(f"header lists {len(metas) if isinstance(metas, list) else '?'} tensors, got {len(frames) - 1} buffers")
    out = []
    for meta, buf in zip(metas, frames[1:]):
        dtype = DTYPES.get(meta.get("dtype")) if isinstance(meta, dict) else None
        shape = meta.get("shape") if isinstance(meta, dict) else None
        if dtype is None or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise WireError(f"bad tensor meta {meta!r}")
        numel = int(np.prod(shape)) if shape else 1
        raw = np.frombuffer(buf, dtype=np.uint8)
        if raw.size != numel * torch.empty((), dtype=dtype).element_size():
            raise WireError(f"buffer of {raw.size} bytes does not hold {shape} {meta['dtype']}")
        if numel == 0:
            out.append(torch.empty(shape, dtype=dtype))
        else:
            out.append(torch.from_numpy(raw.copy()).view(dtype).reshape(shape))
    return head, out
