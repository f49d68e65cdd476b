"""Policy objectives, registered by name (as verl's ``register_policy_loss``), and the loss
aggregation that makes them independent of how a mini-batch is split.

Split invariance. A mini-batch is spread over DP ranks and, on each rank, over micro-batches.
Every aggregation here is a *sum* over this micro-batch's tokens or sequences divided by a
normaliser of the whole mini-batch (``LossNorm``: its global token and sequence counts, summed
over DP ranks), so the micro-batch losses of all ranks add up to exactly one objective:

    token-mean:          sum_{b,t} v m / T_global
    seq-mean-token-sum:  sum_b (sum_t v m) / S_global
    seq-mean-token-mean: sum_b (sum_t v m / sum_t m) / S_global

(verl ``agg_loss`` with its ``loss_scale_factor`` / global token count). Gradient averaging
over DP is undone by the caller (multiply by the DP size), never here.

Shapes: B samples, R response positions; ``mask`` [B, R] is 1 on real response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spmd_rl.algos.specs import POLICY_LOSSES

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


@dataclass(frozen=True)
class LossNorm:
    """Global counts of the mini-batch this micro-batch belongs to (all DP ranks together)."""

    tokens: float
    seqs: float


def local_norm(mask: torch.Tensor) -> LossNorm:
    """The normaliser of ``mask`` alone (a batch that is its own mini-batch)."""
    return LossNorm(float(mask.sum()), float(mask.shape[0]))


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, norm: LossNorm | None = None) -> torch.Tensor:
    """Reduce per-token values to this micro-batch's share of the mini-batch objective (module
    docstring); ``norm=None`` treats the batch as the whole mini-batch."""
    norm = norm or local_norm(mask)
    m = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * m).sum() / max(norm.tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return (values * m).sum(-1).sum() / max(norm.seqs, 1.0)
    if mode == "seq-mean-token-mean":
        return ((values * m).sum(-1) / m.sum(-1).clamp(min=1)).sum() / max(norm.seqs, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(AGG_MODES)}")


@dataclass(frozen=True)
class ClipConfig:
    low: float
    high: float
    dual_c: float | None
    agg_mode: str


@dataclass
class PolicyLossOut:
    loss: torch.Tensor
    """This micro-batch's share of the objective (differentiable)."""
    clipped_tokens: torch.Tensor
    """Number of response tokens where the clip was active (a sum, for global fractions)."""


PolicyLoss = Callable[..., PolicyLossOut]
register_policy_loss = POLICY_LOSSES.register  # the built-ins are declared in algos.specs
get_policy_loss = POLICY_LOSSES.lookup


def tis_weight(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling for the rollout/training mismatch (verl rollout
    correction, TRL): w = min(exp(old_logp - rollout_logp), cap), per token, no gradient."""
    return torch.exp((old_logp - rollout_logp).clamp(-20, 20)).clamp(max=cap).detach()


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip: ClipConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token L = max(-A r, -A clip(r, 1 - low, 1 + high)); dual clip for A < 0:
    L = min(L, -A c). Returns (L, clip-active indicator)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip.low, 1 + clip.high)
    loss = torch.maximum(unclipped, clipped)
    if clip.dual_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * clip.dual_c), loss)
    return loss, (clipped > unclipped)


def _finish(
    per_token: torch.Tensor,
    active: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipConfig,
    norm: LossNorm | None,
    weight: torch.Tensor | None,
) -> PolicyLossOut:
    if weight is not None:
        per_token = per_token * weight
    clipped = (
        (active.to(per_token.dtype) * mask.to(per_token.dtype)).sum().detach()
    )  # a tensor: no host sync per micro-batch
    return PolicyLossOut(aggregate(per_token, mask, clip.agg_mode, norm), clipped)


def vanilla_ppo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipConfig,
    norm: LossNorm | None = None,
    weight: torch.Tensor | None = None,
) -> PolicyLossOut:
    """PPO clipped surrogate with a token ratio r_t = exp(logp_t - old_logp_t), separate low/high
    clip ratios (DAPO clip-higher: high > low) and dual clip. ``weight`` (e.g. TIS) multiplies
    each token's loss. ``advantages`` is [B, R] or [B] (one scalar per sample)."""
    adv = advantages if advantages.dim() == logp.dim() else advantages[:, None]
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    per_token, active = _clipped_surrogate(ratio, adv, clip)
    return _finish(per_token, active, mask, clip, norm, weight)


def gspo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipConfig,
    norm: LossNorm | None = None,
    weight: torch.Tensor | None = None,
) -> PolicyLossOut:
    """GSPO (Zheng et al. 2025): sequence-level ratio s_b = exp(mean_t (logp - old_logp)) over
    the response tokens, used per token as s_{b,t} = sg[s_b] * exp(logp_t - sg[logp_t]) (equal
    in value to s_b, gradient of log s_b spread over the tokens), then the same clipped
    surrogate as vanilla with the clip bounds on s_b."""
    adv = advantages if advantages.dim() == logp.dim() else advantages[:, None]
    m = mask.to(logp.dtype)
    log_s = ((logp - old_logp) * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_ratio = log_s.detach()[:, None] + logp - logp.detach()
    ratio = torch.exp(log_ratio.clamp(-20, 20))
    per_token, active = _clipped_surrogate(ratio, adv, clip)
    return _finish(per_token, active, mask, clip, norm, weight)


def cispo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipConfig,
    norm: LossNorm | None = None,
    weight: torch.Tensor | None = None,
) -> PolicyLossOut:
    """CISPO (MiniMax-M1, 2025): the importance weight is clipped and detached, and every token
    keeps its gradient: L_t = -sg[clip(r_t, 1 - low, 1 + high)] A_t log pi(t), with r_t =
    exp(logp_t - old_logp_t). Unlike PPO's clip, a token outside the band still contributes
    (its gradient scaled by the bound), so rare high-ratio tokens are not dropped. The clip
    fraction counts the tokens whose weight was clipped."""
    adv = advantages if advantages.dim() == logp.dim() else advantages[:, None]
    ratio = torch.exp((logp - old_logp).clamp(-20, 20)).detach()
    bounded = ratio.clamp(1 - clip.low, 1 + clip.high)
    return _finish(-bounded * adv * logp, bounded != ratio, mask, clip, norm, weight)
