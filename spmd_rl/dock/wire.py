"""Wire format of the dock: one msgpack header frame followed by raw tensor buffers.

Never pickle: a header is msgpack of plain maps/lists/str/int/float/bool, and tensors travel as
their bytes with (dtype, shape) in the header. Only the dtypes in ``DTYPES`` are accepted, so a
peer cannot make the receiver build arbitrary objects.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np
import torch

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 64 << 20
MAX_DIMS = 8
MAX_ELEMENTS = 1 << 40


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


def decode_header(frame: bytes | memoryview) -> dict[str, Any]:
    if len(frame) > MAX_HEADER_BYTES:
        raise WireError("header too large")
    try:
        head = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WireError(f"malformed header: {exc}") from None
    if not isinstance(head, dict):
        raise WireError("header is not a map")
    return head


def is_int(x: Any) -> bool:
    """An int that is not a bool (JSON headers: ``true`` must not pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_meta(meta: Any) -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, byte count) of one tensor meta, or WireError. Python ints throughout, so a
    hostile shape cannot overflow; at most ``MAX_DIMS`` dims and ``MAX_ELEMENTS`` elements."""
    if not isinstance(meta, dict):
        raise WireError(f"tensor meta is not a map: {meta!r:.80}")
    name, shape = meta.get("dtype"), meta.get("shape")
    if not isinstance(name, str) or name not in DTYPES:
        raise WireError(f"bad tensor dtype {name!r:.80}; allowed: {', '.join(DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(is_int(d) and 0 <= d <= MAX_ELEMENTS for d in shape)
    ):
        raise WireError(f"bad tensor shape {shape!r:.80}")
    numel = math.prod(shape)
    if numel > MAX_ELEMENTS:
        raise WireError(f"tensor of {numel} elements exceeds the limit of {MAX_ELEMENTS}")
    dtype = DTYPES[name]
    return dtype, shape, numel * dtype.itemsize


def decode_tensors(metas: Any, buffers: list[bytes | memoryview]) -> list[torch.Tensor]:
    """The tensors of a decoded header's ``tensors`` metas; each buffer must hold exactly its
    declared bytes and is copied once."""
    if not isinstance(metas, list) or len(metas) != len(buffers):
        raise WireError(
            f"header lists {len(metas) if isinstance(metas, list) else '?'} tensors, got {len(buffers)} buffers"
        )
    out = []
    for meta, buf in zip(metas, buffers):
        dtype, shape, nbytes = check_meta(meta)
        raw = np.frombuffer(buf, dtype=np.uint8)
        if raw.size != nbytes:
            raise WireError(f"buffer of {raw.size} bytes does not hold {shape} {meta['dtype']}")
        if nbytes == 0:
            out.append(torch.empty(shape, dtype=dtype))
        else:
            out.append(torch.from_numpy(raw.copy()).view(dtype).reshape(shape))
    return out


def decode(frames: list[bytes | memoryview]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Inverse of :func:`encode`; validates dtypes, shapes and byte counts, copies each buffer once."""
    if not frames:
        raise WireError("empty message")
    head = decode_header(frames[0])
    return head, decode_tensors(head.pop("tensors", []), list(frames[1:]))
