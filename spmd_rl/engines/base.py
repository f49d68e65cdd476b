"""The one interface every role's engine implements (actor, reference, critic, reward model). The resharder, the stages,
the update and the checkpoint code depend on this,
never on the FSDP class, so another backend (megatron-core, pipeline parallel) implements
these methods and nothing else changes.

Invariants an implementation keeps:

- ``full_weights`` yields every weight the rollout engine loads once, by its HF name and in its
  full shape, in the same order on every rank (its gathers are collectives), and
  ``weight_shapes`` lists the same names and shapes in that order without gathering;
- ``param_tensors`` / ``grad_tensors`` / ``optimizer_tensors`` are this rank's *local*
  storage (what the host swap moves and the ledger counts), never gathered copies;
- ``save`` then ``load`` into an engine of any layout restores the same full weights and
  optimizer state (DCP reshards).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from spmd_rl.distributed.accelerator import Accelerator

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LossFn = Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor]
"""(outputs [b, R]: log-probs or values, entropies [b, R] or None, micro-batch number) -> scalar loss to backprop."""


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly distributed) tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


class Engine(ABC):
    acc: Accelerator
    trainable: bool

    @abstractmethod
    def infer(self, micro_batches: list, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The role's outputs without gradients, one forward per micro-batch (the caller splits,
        as for ``train_step``), concatenated: per-token log-probs [B, R] (and entropies) of a
        policy, per-token values [B, R] of a critic, scores [B] of a reward model."""

    @abstractmethod
    def train_step(self, micro_batches: list, loss_fn: LossFn, with_entropy: bool = False) -> dict[str, float]:
        """Backward over the micro-batches, clip, optimizer and schedule step; loss, grad_norm, lr.
        ``loss_fn`` receives the same outputs as ``infer`` (with gradients) per micro-batch."""

    @abstractmethod
    def weight_shapes(self) -> list[tuple[str, list[int]]]:
        """(HF name, full shape) of each tensor ``full_weights`` yields, in its order."""

    @abstractmethod
    def full_weights(self, dtype: torch.dtype, bucket_bytes: float) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """(peak temporary bytes of the gather, an iterator of (HF name, full tensor in ``dtype``)):
        the rollout engine's weights, gathered with temporaries bounded by ``bucket_bytes``
        where the backend buckets; collective over the role's ranks."""

    @abstractmethod
    def param_tensors(self) -> list[torch.Tensor]:
        """Local storage of the parameters."""

    @abstractmethod
    def grad_tensors(self) -> list[torch.Tensor]:
        """Local storage of the gradients that exist now."""

    @abstractmethod
    def optimizer_tensors(self) -> list[torch.Tensor]:
        """Local storage of the optimizer states (none for a frozen role)."""

    @abstractmethod
    def save(self, folder: str | Path) -> None:
        """Write this role's state (collective over the role's ranks)."""

    @abstractmethod
    def load(self, folder: str | Path) -> None:
        """Read a state written by ``save`` in any layout."""
