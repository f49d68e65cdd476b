"""The policy update's per-micro-batch objective and the sums it records (``actor_update`` runs
the loop). For micro-batch s of a mini-batch with normaliser ``norm`` (``minibatch``):

    L_s = objective(lp, old, A, mask; clip, norm, w)              (``algos.policy_loss``, by name)
          + kl_coef * agg(KL(lp || ref))                           (with ``algorithm.use_kl_loss``)
          - entropy_coef * agg(H)                                   (with ``actor.loss.entropy_coef``)

times the training DP size (FSDP averages gradients over dp_shard: undone so the mini-batch's
objective is one sum over its ranks). ``old`` is the old policy's log-probs when the graph
computes them, else ``lp`` detached (on policy). ``w`` is the rollout correction
(``algos.rollout_correction``): the product of the TIS weight, IcePop's and MIS's, None when
every one is off."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from spmd_rl.algos.core import kl_estimate
from spmd_rl.algos.policy_loss import ClipConfig, aggregate, tis_weight
from spmd_rl.algos.rollout_correction import icepop_weight, mis_mask

SUMS = (
    "loss",
    "clipped",
    "kl",
    "entropy",
    "tokens",
    "mismatch_sum",
    "mismatch_tokens",
    "rollout_kl",
    "icepop_masked",
    "mis_rejected",
    "seqs",
)


def on_host(sums: dict) -> dict[str, float]:
    """The metric sums, kept on the device through the micro-batches (a ``float()`` each would
    sync the host before every backward), brought to the host in one copy."""
    values = [torch.as_tensor(v).detach().double().reshape(()) for v in sums.values()]
    device = next((v.device for v in values if v.device.type != "cpu"), torch.device("cpu"))
    return dict(zip(sums, torch.stack([v.to(device) for v in values]).cpu().tolist()))


class UpdateSums(dict):
    """The update's sums (``SUMS``) and the largest behaviour mismatch, on the device until
    ``to_host``. The mismatch, rollout KL and correction counts are the first epoch's."""

    def __init__(self) -> None:
        super().__init__(dict.fromkeys(SUMS, 0.0) | {"mismatch_max": 0.0})

    def mismatch(self, old_lp: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor, m: torch.Tensor) -> None:
        """|old - rollout| per token (sum, count, max), the rollout KL estimate sum(rollout - old)
        and the sequences seen."""
        diff = (old_lp.detach() - roll) * m
        self["mismatch_sum"] += diff.abs().sum()
        self["mismatch_tokens"] += m.sum()
        if m.numel():
            self["mismatch_max"] = torch.maximum(
                torch.as_tensor(self["mismatch_max"], device=diff.device), diff.abs().max()
            )
        self["rollout_kl"] += (-diff).sum()
        self["seqs"] += float(mask.any(-1).sum())

    def to_host(self) -> dict[str, float]:
        return on_host(self)


@dataclass
class PolicyObjective:
    """The update's inputs, in the loop's order: per-token advantages, rollout, reference and
    old log-probs ([B, R], ``ref``/``old`` None when the graph has none), the response mask."""

    actor: object
    """``ActorConfig``."""
    algorithm: object
    """``AlgorithmConfig``."""
    objective: object
    """The registered policy loss (``algos.policy_loss.get_policy_loss``)."""
    mask: torch.Tensor
    adv: torch.Tensor
    rollout: torch.Tensor
    ref: torch.Tensor | None
    old: torch.Tensor | None
    dp: int

    @cached_property
    def clip(self) -> ClipConfig:
        a = self.actor
        return ClipConfig(a.loss.clip_ratio_low, a.loss.clip_ratio_high, a.loss.clip_ratio_c, a.loss.loss_agg_mode)

    def correction(self, old_lp, roll, mask, sums: UpdateSums | None) -> torch.Tensor | None:
        """The rollout-correction weight of each token, None when every one is off; ``sums``
        (the first epoch's) count what IcePop masked and MIS rejected."""
        a = self.actor
        weights = [tis_weight(old_lp, roll, a.correction.tis_cap)] if a.correction.tis_cap is not None else []
        if a.correction.icepop_band is not None:  # the config refuses it beside TIS: it is the importance weight itself
            weights.append(icepop_weight(old_lp, roll, a.correction.icepop_band))
            if sums is not None:
                sums["icepop_masked"] += ((weights[-1] == 0) * mask).sum()  # rho > 0: zero weight is a masked token
        if a.correction.mis_band is not None:
            weights.append(mis_mask(old_lp, roll, mask, a.correction.mis_band))
            if sums is not None:
                sums["mis_rejected"] += ((1 - weights[-1]) * mask).any(-1).sum()
        return math.prod(weights[1:], start=weights[0]) if weights else None

    def loss(self, lp, ent, s: slice, norm, sums: UpdateSums, first_epoch: bool) -> torch.Tensor:
        """L_s (module docstring) of the rows ``s``, recording its sums."""
        a, al = self.actor, self.algorithm
        mask = self.mask[s].to(lp.device)
        m = mask.to(lp.dtype)
        old_lp = self.old[s].to(lp.device) if self.old is not None else lp.detach()
        roll = self.rollout[s].to(lp.device)
        weight = self.correction(old_lp, roll, mask, sums if first_epoch else None)
        out = self.objective(lp, old_lp, self.adv[s].to(lp.device), mask, self.clip, norm, weight)
        loss = out.loss
        if self.ref is not None:
            kl = kl_estimate(lp, self.ref[s].to(lp.device), al.kl_estimator)
            sums["kl"] += (kl.detach() * m).sum()
            if al.use_kl_loss:
                loss = loss + al.kl_coef * aggregate(kl, mask, a.loss.loss_agg_mode, norm)
        sums["entropy"] += (ent.detach() * m).sum()
        if a.loss.entropy_coef:
            loss = loss - a.loss.entropy_coef * aggregate(ent, mask, a.loss.loss_agg_mode, norm)
        sums["loss"] += loss.detach()
        sums["clipped"] += out.clipped_tokens
        sums["tokens"] += m.sum()
        if first_epoch:
            sums.mismatch(old_lp, roll, mask, m)
        return loss * self.dp
