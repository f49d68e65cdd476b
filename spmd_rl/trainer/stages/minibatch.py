"""What the two update stages share: the mini-batch schedule and the split-invariant normaliser.

Invariant (tested): the gradient of one optimizer step is that of ONE objective over the whole
mini-batch, whatever ``micro_batch_size`` and whatever the training layout (dp_shard x tp):
every micro-batch loss is normalised by the mini-batch's global token / sequence count
(all-reduced over the DP ranks), and multiplied by the DP size because FSDP averages the
gradients over ``dp_shard``. Metrics are global: sums over all DP ranks (each DP group counted
once), divided by global counts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spmd_rl.algos.policy_loss import LossNorm
from spmd_rl.config.schema import Config
from spmd_rl.trainer.metrics import global_sums


def dp_sums(values: dict[str, float], copies: int, group) -> dict[str, float]:
    """Sums over the ranks of ``group`` (the training side, ``Run.sides.group``), each DP group
    counted once (``copies``: its ranks, which hold identical data: ``Layout.group``)."""
    return {k: v / copies for k, v in global_sums(values, group).items()}


def mini_batch_norm(
    mask: torch.Tensor, copies: int, group, replica_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> LossNorm:
    """Global response-token and sequence counts of a mini-batch whose DP shares are spread
    over the ranks (``mask`` is this rank's share); with elastic replicas, summed over the
    replicas too (``replica_sum``: each replica holds its share of the global batch);
    ``copies``, ``group``: see ``dp_sums``."""
    g = dp_sums({"tokens": float(mask.sum()), "seqs": float(mask.shape[0])}, copies, group)
    if replica_sum is None:
        return LossNorm(g["tokens"], g["seqs"])
    total = replica_sum(torch.tensor([g["tokens"], g["seqs"]], dtype=torch.float64))
    return LossNorm(float(total[0]), float(total[1]))


def mini_batch_count(cfg: Config) -> int:
    """Optimizer steps per epoch: mini-batch j is the prompt groups [j B, (j + 1) B) of the
    iteration's batch (B = ``actor.mini_batch_size``), its samples shared over the DP ranks on
    its own (``Stage.mini_batched``), so rank d's rows of mini-batch j are the j-th run of
    ``mini_batches``."""
    return cfg.data.global_batch_size // cfg.actor.mini_batch_size


def _per_rank(cfg: Config, dp: int) -> int:
    return cfg.actor.mini_batch_size * cfg.rollout.n // dp


def mini_batches(cfg: Config, dp: int, local_samples: int) -> list[slice]:
    """This rank's rows of each mini-batch of one epoch: ``actor.mini_batch_size`` prompts (x N
    samples, over all DP ranks), one optimizer step each. ``actor.ppo_epochs`` passes repeat
    them in the same order."""
    per_rank = _per_rank(cfg, dp)
    return [slice(start, min(start + per_rank, local_samples)) for start in range(0, local_samples, per_rank)]


def length_order(cfg: Config, dp: int, lengths: torch.Tensor) -> torch.Tensor:
    """A permutation of this rank's rows: longest first within each mini-batch of ``schedule``,
    membership unchanged. Micro-batches then hold samples of similar length, and the engine
    trims each to its own longest one (``SeqBatch.trim``), so little padding is computed. The
    objective is unchanged: every loss is a sum over the mini-batch's samples and tokens with a
    global normaliser. Forward stages and updates use the same order, so the first epoch's
    recomputed log-probs are bit-identical to the update's."""
    per_rank = _per_rank(cfg, dp)
    parts = [
        start + torch.argsort(lengths[start : start + per_rank], descending=True, stable=True)
        for start in range(0, lengths.numel(), per_rank)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
