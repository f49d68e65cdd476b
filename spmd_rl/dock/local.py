"""The in-process path to the warehouse this process serves: same calls as
:class:`~spmd_rl.dock.warehouse_client.WarehouseClient`, no wire.

The rank that serves its node's warehouse (local rank 0) puts every one of its samples there
and reads 1/S of its inputs from it. Over the wire each such byte is copied into one flat
tensor, MAC'd, sent through a socket, received, MAC'd again and copied out; here it is copied
once each way, and nothing crosses a trust boundary, so there is nothing to authenticate.

Invariants (``tests/integration/test_dock_local.py``): a put and a get give the same stored data, the same
byte counts (Eq. (4)) and the same refusals as the wire path; a caller that writes to a tensor
after ``put``, or to a tensor ``get`` returned, changes nothing stored; once the server thread
has stopped, this path fails as the wire path would (``DockUnavailable``), so a rank does not
keep using a warehouse its peers already consider lost.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd_rl.dock.errors import DockUnavailable
from spmd_rl.dock.host_pool import HostPool
from spmd_rl.dock.store import flatten, unflatten
from spmd_rl.dock.warehouse import WarehouseServer
from spmd_rl.dock.warehouse_client import check_frame_limit
from spmd_rl.dock.wire import dtype_name


def _owned(values: list[torch.Tensor], ragged: bool, pool: HostPool) -> tuple[list[torch.Tensor], int]:
    """(Per-sample views of one flat copy of ``values``, its payload bytes): a single copy, as
    the wire's decode, in a buffer no live tensor shares (``pool`` reuses only freed ones)."""
    flat, lengths = flatten(values, ragged, pool.empty)
    return unflatten(flat, len(values), lengths), flat.numel() * flat.element_size()


class InProcessWarehouse:
    """This process's own warehouse, reached without serialization, MAC or socket."""

    def __init__(self, server: WarehouseServer, name: str, max_message_bytes: int, pool: HostPool):
        """``max_message_bytes``: the wire's frame limit, applied to each column of a put here
        too, so whether a put is refused does not depend on which rank makes it. ``pool``: the
        copies' buffers (``dock.buffer_pool_bytes``)."""
        self.server = server
        self.pool = pool
        self.max_message_bytes = max_message_bytes
        self.name = name
        self.address = server.address

    def _check(self, op: str) -> None:
        if not self.server.serving():
            raise DockUnavailable(
                f"{self.name} at {self.address} is lost (its server thread in this process stopped) during {op}; "
                "exiting so torchrun can restart the group"
            )

    def close(self) -> None:
        """Nothing to release: the server belongs to the dock."""

    def put(
        self, iteration: int, indices: list[int], columns: dict[str, list[torch.Tensor]], ragged: dict[str, bool]
    ) -> None:
        self._check("put")
        for values in columns.values():
            for dtype in {v.dtype for v in values}:
                dtype_name(dtype)  # the wire's dtype table: what remote readers could not decode is refused here too
        big = max((sum(v.numel() * v.element_size() for v in vals) for vals in columns.values()), default=0)
        check_frame_limit("put", big, self.max_message_bytes)
        owned = {name: _owned(values, ragged[name], self.pool)[0] for name, values in columns.items()}
        self.server.store.put(iteration, list(indices), owned, {name: ragged[name] for name in columns})

    def get(self, iteration: int, indices: list[int], names: list[str]) -> dict[str, list[torch.Tensor]]:
        """Per-column list of per-sample tensors (copies), in the order of ``indices``."""
        self._check("get")
        cols, ragged = self.server.store.get(iteration, list(indices), names)
        copies = {name: _owned(cols[name], ragged[name], self.pool) for name in names}
        self.server.store.count_out(iteration, sum(nbytes for _, nbytes in copies.values()))
        return {name: views for name, (views, _) in copies.items()}

    def delete(self, iteration: int, indices: list[int], names: list[str]) -> None:
        self.server.store.delete(iteration, list(indices), names)

    def drop(self, iteration: int) -> None:
        self.server.drop(iteration)

    def stats(self) -> dict[str, Any]:
        return {**self.server.store.stats(), "refused": self.server.refused, "rejected": self.server.rejected}
