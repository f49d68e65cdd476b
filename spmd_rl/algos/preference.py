"""Preference objectives over (chosen, rejected) pairs, registered by name (``algorithm.name``),
as pure functions of sequence log-probabilities.

DPO (Rafailov et al. 2023, Eq. 7), with conservative label smoothing eps (cDPO, Mitchell 2023):
with implicit rewards r_c = beta (log pi(y_c|x) - log pi_ref(y_c|x)) and r_r likewise,

    h = r_c - r_r,    loss = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h),

one value per pair; log pi(y|x) is the sum of the response's token log-probs. eps = 0 is DPO.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spmd_rl.catalog import Registry


@dataclass(frozen=True)
class PairTerms:
    loss: torch.Tensor
    """[P] the objective of each pair."""
    chosen_reward: torch.Tensor
    """[P] r_c, detached."""
    rejected_reward: torch.Tensor
    """[P] r_r, detached."""


PreferenceLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float], PairTerms]
PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss")
get_preference_loss = PREFERENCE_LOSSES.lookup


@PREFERENCE_LOSSES.register("dpo")
def dpo(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> PairTerms:
    """The (c)DPO loss of each pair (module docstring) from [P] sequence log-probs of the policy
    and the reference."""
    r_c = beta * (chosen - ref_chosen)
    r_r = beta * (rejected - ref_rejected)
    h = r_c - r_r
    loss = -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    return PairTerms(loss, r_c.detach(), r_r.detach())
