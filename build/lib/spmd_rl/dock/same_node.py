"""The client of a rank on its warehouse's own node: payloads through shared memory.

On a node of k ranks, local rank 0 serves the warehouse and reaches it in process
(``dock.local``); the other k - 1 ranks used to send every payload over TCP loopback: copied
into frames, MAC'd, through the socket and back, MAC'd again and copied out, about 350 MB/s on
this project's CPU machine. Here a payload of ``SHM_MIN_BYTES`` or more lives in one of this
rank's memfd buffers (``HostPool(memfd_name=...)``) and the warehouse reads or writes it there
in one copy (``dock.shm``); the request itself is still the wire's, authenticated alike.

- ``put``: the columns are flattened straight into one buffer (one copy), the warehouse reads
  them into its own (one copy).
- ``get``: the first request offers no room; a small reply comes inline, a big one answers how
  many bytes it needs; the second request offers a buffer that big, the warehouse writes the
  columns into it, and the samples returned are views of it (one copy in all). The buffer goes
  back to the pool when the last of them is freed.

If the warehouse cannot use this rank's memory (``/proc`` closed to it, another uid), the
refusal is a ``PeerMemoryError``: logged once, and this client uses the wire from then on.
"""

from __future__ import annotations

import logging
import os

import torch

from spmd_rl.dock.errors import DockRequestError
from spmd_rl.dock.host_pool import HostPool
from spmd_rl.dock.shm import SHM_MIN_BYTES, aligned_offsets, memfd_name
from spmd_rl.dock.store import flatten, unflatten
from spmd_rl.dock.warehouse_client import WarehouseClient, check_frame_limit
from spmd_rl.dock.wire import check_meta, tensor_meta

log = logging.getLogger(__name__)


class SameNodeWarehouse(WarehouseClient):
    def __init__(self, address: str, token: str, pool_bytes: int, **kwargs):
        """``pool_bytes``: idle bytes of freed buffers kept for reuse (``dock.buffer_pool_bytes``)."""
        super().__init__(address, token, **kwargs)
        self.pool = HostPool(pool_bytes, memfd_name=memfd_name(self.key))
        self.shared = True
        self.shm_bytes = 0
        """Payload bytes moved through shared memory, both ways."""

    def _wire_from_now_on(self, exc: DockRequestError) -> bool:
        if exc.kind != "PeerMemoryError":
            return False
        self.shared = False
        log.warning(
            "%s at %s cannot use this rank's shared memory (%s); using the wire from now on",
            self.name,
            self.address,
            exc,
        )
        return True

    def put(
        self, iteration: int, indices: list[int], columns: dict[str, list[torch.Tensor]], ragged: dict[str, bool]
    ) -> None:
        sizes = [sum(v.numel() * v.element_size() for v in values) for values in columns.values()]
        if not self.shared or sum(sizes) < SHM_MIN_BYTES:
            return super().put(iteration, indices, columns, ragged)
        for nbytes in sizes:
            check_frame_limit("put", nbytes, self.max_message_bytes)
        offsets, total = aligned_offsets(sizes)
        buf, region = self.pool.region(total)
        meta = {}
        for (name, values), offset, nbytes in zip(columns.items(), offsets, sizes):
            flat, lengths = flatten(
                values, ragged[name], lambda numel, dtype, a=offset, b=offset + nbytes: buf[a:b].view(dtype)
            )
            meta[name] = {"ragged": ragged[name], "lengths": lengths, "offset": offset, **tensor_meta(flat)}
        ref = {"pid": os.getpid(), "fd": region.fd, "ino": region.ino}
        try:
            self.request({"op": "put", "iter": iteration, "indices": list(indices), "columns": meta, "shm": ref})
        except DockRequestError as exc:
            if not self._wire_from_now_on(exc):
                raise
            return super().put(iteration, indices, columns, ragged)
        self.shm_bytes += sum(sizes)

    def get(self, iteration: int, indices: list[int], names: list[str]) -> dict[str, list[torch.Tensor]]:
        if not self.shared:
            return super().get(iteration, indices, names)
        header = {"op": "get", "iter": iteration, "indices": list(indices), "columns": list(names)}
        buf, ref = None, {"pid": os.getpid(), "fd": 0, "ino": 0, "capacity": 0}
        try:
            for _ in range(2):
                replies = self.request(header | {"shm": ref})
                head = replies[0][0]
                if "placed" in head and buf is not None:
                    return self._views(buf, head["placed"], names, len(indices))
                if "need" not in head:
                    return self.samples(replies, names)
                buf, region = self.pool.region(int(head["need"]))
                ref = {"pid": os.getpid(), "fd": region.fd, "ino": region.ino, "capacity": buf.numel()}
        except DockRequestError as exc:
            if not self._wire_from_now_on(exc):
                raise
            return super().get(iteration, indices, names)
        raise DockRequestError(f"{self.name} at {self.address} asked twice for a bigger buffer for one get")

    def _views(self, buf: torch.Tensor, placed: dict, names: list[str], n: int) -> dict[str, list[torch.Tensor]]:
        out = {}
        for name in names:
            spec = placed[name]
            dtype, shape, nbytes = check_meta(spec)
            offset = spec["offset"]
            if not 0 <= offset <= offset + nbytes <= buf.numel():
                raise DockRequestError(f"{self.name} placed column {name!r} outside the buffer it was given")
            out[name] = unflatten(
                buf[offset : offset + nbytes].view(dtype).reshape(shape),
                n,
                spec.get("lengths") if spec["ragged"] else None,
            )
            self.shm_bytes += nbytes
        return out
