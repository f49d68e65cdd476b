"""Column declarations of the sample flow: dtype, ragged or fixed trailing shape, writer stage.

Ragged columns (token sequences and per-token values) are stored unpadded, one 1-D tensor per
sample; fixed columns store one tensor of ``shape`` per sample. Token ids are int32 (the
paper's B = 4 bytes), per-token values float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spmd_rl.recipe.graph import COLUMNS, DATA_COLUMNS, PARTIAL_COLUMNS, PREFIX_EXTRA, Stage
from spmd_rl.dock.errors import DockRequestError


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    dtype: torch.dtype
    ragged: bool
    writer: str
    shape: tuple[int, ...] = ()
    """Per-sample trailing shape of a fixed column; () for a scalar. Unused when ragged."""


_DTYPES = {
    "prompt_ids": torch.int32,
    "answer": torch.uint8,
    "response_ids": torch.int32,
    "response_length": torch.int32,
    "response_version": torch.int32,
    "prompt_row": torch.int32,
    "prefix_ids": torch.int32,
    "prefix_version": torch.int32,
    "prefix_done": torch.int32,
    "rollout_routes": torch.uint8,
    "prefix_routes": torch.uint8,
    "response_mask": torch.uint8,
    "prefix_mask": torch.uint8,
}


def columns_for(stages: list[Stage]) -> dict[str, ColumnSpec]:
    """Specs of every column written by ``stages`` and by the data loader (``DATA_COLUMNS``, and
    the ``PARTIAL_COLUMNS`` the rollout reads under partial rollout)."""
    writers = dict.fromkeys(
        DATA_COLUMNS + tuple(c for c in PARTIAL_COLUMNS + PREFIX_EXTRA if stages and c in stages[0].inputs), "data"
    )
    for s in stages:
        writers.update({c: s.name for c in s.outputs})
    return {
        name: ColumnSpec(name, _DTYPES.get(name, torch.float32), COLUMNS[name] != "scalar", writer)
        for name, writer in writers.items()
    }


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
