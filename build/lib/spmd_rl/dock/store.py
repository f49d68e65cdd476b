"""One node's samples in host memory: ``{iteration: {column: {index: tensor}}}``; a ragged
column holds one unpadded 1-D tensor per sample. A put is atomic: it is fully validated
before anything is stored, so a refused put leaves earlier data intact. Stored tensors are
owned by the store and never written in place (a put stores its own copy, a reader gets a
copy), so references handed out under the lock stay valid after it is released."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

import torch

from spmd_rl.dock.errors import DockRequestError


def flatten(
    values: list[torch.Tensor],
    ragged: bool,
    empty: Callable[[int, torch.dtype], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[int] | None]:
    """Samples -> (one flat tensor, per-sample lengths for ragged columns). ``empty(numel,
    dtype)`` allocates the flat tensor (``dock.host_pool``); default: torch's allocator."""
    if not values:
        return torch.empty(0), [] if ragged else None
    lengths = [v.numel() for v in values] if ragged else None
    if empty is None:
        return (torch.cat([v.reshape(-1) for v in values]) if ragged else torch.stack(values)), lengths
    out = empty(sum(v.numel() for v in values), values[0].dtype)
    if ragged:
        return torch.cat([v.reshape(-1) for v in values], out=out), lengths
    return torch.stack(values, out=out.view(len(values), *values[0].shape)), None


def unflatten(flat: torch.Tensor, n: int, lengths: list[int] | None) -> list[torch.Tensor]:
    if lengths is not None:
        if len(lengths) != n or sum(lengths) != flat.numel():
            raise DockRequestError(
                f"ragged lengths {len(lengths)} / {sum(lengths)} do not match {n} samples / {flat.numel()} values"
            )
        return list(torch.split(flat, lengths))
    if flat.shape[:1] != (n,):
        raise DockRequestError(f"fixed column has leading size {tuple(flat.shape[:1])}, expected {n}")
    return list(flat.unbind(0))


class WarehouseStore:
    """The in-memory columns of one node. Thread-safe: the server thread and, for the node's
    own rank, the in-process path (``dock.local``) both use it; every method holds one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.data: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
        self.ragged: dict[int, dict[str, bool]] = {}
        self.bytes_in = 0
        self.bytes_out = 0
        self.bytes_out_by_iter: dict[int, int] = defaultdict(int)

    def put(
        self, iteration: int, indices: list[int], columns: dict[str, list[torch.Tensor]], ragged: dict[str, bool]
    ) -> None:
        with self._lock:
            cols = self.data.get(iteration, {})
            kinds = self.ragged.get(iteration, {})
            for name in columns:
                if kinds.get(name, ragged[name]) != ragged[name]:
                    raise DockRequestError(
                        f"column {name!r} was stored as {'ragged' if kinds[name] else 'fixed'}; this put sends it "
                        f"otherwise"
                    )
                dup = [i for i in indices if i in cols.get(name, {})]
                if dup:
                    raise DockRequestError(
                        f"column {name!r} already stored for indices {dup[:8]}{'...' if len(dup) > 8 else ''} of "
                        f"iteration {iteration}: duplicate put"
                    )
            if len(set(indices)) != len(indices):
                raise DockRequestError("indices of one put must be distinct")
            cols = self.data.setdefault(iteration, {})
            self.ragged.setdefault(iteration, {}).update(ragged)
            for name, values in columns.items():
                store = cols.setdefault(name, {})
                for i, v in zip(indices, values):
                    store[i] = v
                    self.bytes_in += v.numel() * v.element_size()

    def get(
        self, iteration: int, indices: list[int], names: list[str]
    ) -> tuple[dict[str, list[torch.Tensor]], dict[str, bool]]:
        """(per-column stored tensors in the order of ``indices``, whether each column is ragged).
        The tensors are the store's own: callers copy them out and never write to them."""
        with self._lock:
            cols = self.data.get(iteration, {})
            out = {}
            for name in names:
                store = cols.get(name, {})
                missing = [i for i in indices if i not in store]
                if missing:
                    raise DockRequestError(
                        f"column {name!r} not stored here for indices {missing[:8]} of iteration {iteration}"
                    )
                out[name] = [store[i] for i in indices]
            kinds = self.ragged.get(iteration, {})
            return out, {name: kinds[name] for name in names}

    def count_out(self, iteration: int, nbytes: int) -> None:
        """Account ``nbytes`` of payload read out of ``iteration`` (Eq. (4)'s read side)."""
        with self._lock:
            self.bytes_out += nbytes
            self.bytes_out_by_iter[iteration] += nbytes

    def delete(self, iteration: int, indices: list[int], names: list[str]) -> None:
        with self._lock:
            cols = self.data.get(iteration, {})
            for name in names:
                for i in indices:
                    cols.get(name, {}).pop(i, None)

    def drop(self, iteration: int) -> None:
        with self._lock:
            self.data.pop(iteration, None)
            self.ragged.pop(iteration, None)

    def stats(self) -> dict[str, object]:
        """Payload bytes in and out (in total and read out per iteration) and samples held."""
        with self._lock:
            return {
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "samples": sum(len(col) for cols in self.data.values() for col in cols.values()),
                "bytes_out_by_iter": {str(k): v for k, v in self.bytes_out_by_iter.items()},
            }
