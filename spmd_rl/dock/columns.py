"""Column specs of the dock: dtype, ragged or fixed trailing shape, writer stage. Which
columns a run has is the caller's (``recipe.columns``): the dock stores what it is given.

Ragged columns (token sequences and per-token values) are stored unpadded, one 1-D tensor per
sample; fixed columns store one tensor of ``shape`` per sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from spmd_rl.dock.errors import DockRequestError


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    dtype: torch.dtype
    ragged: bool
    writer: str
    shape: tuple[int, ...] = ()
    """Per-sample trailing shape of a fixed column; () for a scalar. Unused when ragged."""


def specs_of(decls: Mapping[str, Any]) -> dict[str, ColumnSpec]:
    """The specs of declared columns: each with ``name``, ``dtype`` (a torch dtype's name),
    ``ragged`` and ``writer`` (``recipe.columns.ColumnDecl``)."""
    return {name: ColumnSpec(name, getattr(torch, d.dtype), d.ragged, d.writer) for name, d in decls.items()}


def as_samples(name: str, value: Any, n: int, spec: ColumnSpec) -> list[torch.Tensor]:
    """Validate one column of a put against its spec and return per-sample tensors."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        value = list(value.unbind())
    if spec.ragged:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in value):
            raise DockRequestError(
                f"column {name!r} is ragged: pass a list (or nested tensor) of 1-D tensors, one per index"
            )
        samples = list(value)
    else:
        if not isinstance(value, torch.Tensor) or tuple(value.shape[1:]) != spec.shape or value.dim() < 1:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise DockRequestError(
                f"column {name!r} must be a tensor of shape [B, {', '.join(map(str, spec.shape))}] (per-sample "
                f"{spec.shape}), got {got}"
            )
        samples = list(value.unbind(0))
    if len(samples) != n:
        raise DockRequestError(f"column {name!r} has {len(samples)} samples for {n} indices")
    bad = {str(v.dtype) for v in samples if v.dtype != spec.dtype}
    if bad:
        raise DockRequestError(
            f"column {name!r} must be {spec.dtype}, got {', '.join(sorted(bad))}: cast it before put"
        )
    return [v.detach().cpu() for v in samples]
