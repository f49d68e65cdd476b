"""Message authentication on the dock's wire: the job token never travels.

A message is ``[mac, header, *buffers]`` (``wire.encode`` gives ``[header, *buffers]``) with

    mac = HMAC-SHA256(key, direction || u64(len(f_1)) || f_1 || ... || u64(len(f_n)) || f_n)
    key = SHA-256("spmd-rl dock v1" || token)

``direction`` is ``b"req"`` or ``b"rep"``, so a request cannot be reflected as a reply. The
receiver checks the mac over the frames as they arrived (no parsing, no copy) before it
decodes anything, so an unauthenticated peer cannot make it parse a header or allocate.

Not covered: confidentiality (the frames are not encrypted) and replay of a captured message
within the same job; run the data plane on the cluster's private network.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

MAC_BYTES = 32
DIRECTIONS = (b"req", b"rep")


def job_key(token: str) -> bytes:
    return hashlib.sha256(b"spmd-rl dock v1" + token.encode()).digest()


def _nbytes(frame: Any) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def mac(key: bytes, direction: bytes, frames: Sequence[Any]) -> bytes:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}")
    h = hmac.new(key, direction, hashlib.sha256)
    for f in frames:
        h.update(_nbytes(f).to_bytes(8, "little"))
        h.update(f)
    return h.digest()


def seal(key: bytes, direction: bytes, frames: list[Any]) -> list[Any]:
    """``[mac] + frames``."""
    return [mac(key, direction, frames), *frames]


def verify(key: bytes, direction: bytes, frames: Sequence[Any]) -> bool:
    """True when ``frames`` is ``[mac, header, ...]`` with the mac of this key and direction."""
    if len(frames) < 2 or _nbytes(frames[0]) != MAC_BYTES:
        return False
    return hmac.compare_digest(bytes(frames[0]), mac(key, direction, frames[1:]))
