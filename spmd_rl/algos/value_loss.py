"""Critic objectives, registered by name like the policy losses.

``clipped`` (PPO, verl ``compute_value_loss``): with old values V_old (from the critic_value
stage), returns R and new predictions V,

    V_clip = clamp(V, V_old - c, V_old + c)
    loss   = 1/2 * agg( max((V - R)^2, (V_clip - R)^2) )

with ``c = algorithm.value_clip`` (no clip when None: loss = 1/2 agg((V - R)^2)) and ``agg``
the split-invariant aggregation of ``policy_loss.aggregate``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spmd_rl.algos.policy_loss import LossNorm, aggregate
from spmd_rl.catalog import Registry


@dataclass(frozen=True)
class ValueLossOut:
    loss: torch.Tensor
    clipped_tokens: float
    """Tokens where the clipped branch is the larger one (verl's vf_clipfrac numerator)."""


ValueLoss = Callable[..., ValueLossOut]
VALUE_LOSSES: Registry[ValueLoss] = Registry("value loss")
register_value_loss = VALUE_LOSSES.register
get_value_loss = VALUE_LOSSES.lookup


@register_value_loss("clipped")
def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    agg_mode: str,
    norm: LossNorm | None = None,
) -> ValueLossOut:
    unclipped = (values - returns).square()
    if clip is None:
        return ValueLossOut(0.5 * aggregate(unclipped, mask, agg_mode, norm), 0.0)
    clipped = (torch.clamp(values, old_values - clip, old_values + clip) - returns).square()
    worst = torch.maximum(unclipped, clipped)
    n_clipped = float(((clipped > unclipped) & mask.bool()).sum())
    return ValueLossOut(0.5 * aggregate(worst, mask, agg_mode, norm), n_clipped)
