"""A stage's share of an iteration as the dock hands it out: sample indices and per-sample
tensors per column, padded into a TensorDict or as jagged nested tensors on request."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from tensordict import TensorDict


@dataclass
class DockBatch:
    """A stage's share: sample indices (ascending) and per-column lists of per-sample tensors."""

    indices: torch.Tensor
    columns: dict[str, list[torch.Tensor]]
    ragged: frozenset[str]

    def __len__(self) -> int:
        return int(self.indices.numel())

    def padded(self, pad: Mapping[str, float | int] | None = None) -> TensorDict:
        """TensorDict of batch size [B]: ragged columns right-padded to the longest sample (pad
        value per column, default 0) with ``<name>_length``; fixed columns stacked."""
        out: dict[str, torch.Tensor] = {"index": self.indices}
        for name, values in self.columns.items():
            if name in self.ragged:
                lengths = torch.tensor([v.numel() for v in values], dtype=torch.int64)
                out[name] = torch.nn.utils.rnn.pad_sequence(
                    values, batch_first=True, padding_value=(pad or {}).get(name, 0)
                )
                out[f"{name}_length"] = lengths
            else:
                out[name] = torch.stack(values) if values else torch.empty(0)
        return TensorDict(out, batch_size=[len(self)])

    def jagged(self, name: str) -> torch.Tensor:
        """A ragged column as a jagged nested tensor."""
        return torch.nested.nested_tensor(self.columns[name], layout=torch.jagged)
