"""Rollout correction beyond TIS: what to do with tokens whose training-policy probability and
rollout-engine probability disagree (the rollout/training mismatch; off-policy tokens under
partial rollout and the separated placement). Per token, log rho_t = old_logp_t - rollout_logp_t
(the proximal policy over the behaviour policy). Every output is a detached weight multiplying
the token's loss, so the loss normaliser (and the split invariance, ``policy_loss``) is unchanged.

- TIS (``actor.correction.tis_cap`` c): w_t = min(rho_t, c) (``policy_loss.tis_weight``).
- IcePop (``actor.correction.icepop_band`` [a, b]; Ling team 2025): the importance weight, with tokens whose
  rho_t lies outside [a, b] masked out: w_t = rho_t [a <= rho_t <= b]. It is itself an importance
  weight, so it replaces TIS (the config refuses both).
- MIS, sequence-level masked importance sampling / rejection (``actor.correction.mis_band`` [a, b];
  verl's rollout_rs "geometric"): a sample whose geometric-mean ratio
  rho_b = exp(mean_t log rho_t) lies outside [a, b] is rejected: w_{b,t} = [a <= rho_b <= b].

With ``old_logp`` the actor's log-probs before the update (the ``actor_logprob`` stage) and the
TIS weight, the update is AReaL's decoupled PPO objective: the clip acts on pi / pi_prox, and
pi_prox / pi_behaviour reweights.
"""

from __future__ import annotations

import torch


def _ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor) -> torch.Tensor:
    """rho_t = exp(old - rollout) per token, detached; always > 0 (log rho clamped to +-20)."""
    return torch.exp((old_logp - rollout_logp).detach().clamp(-20, 20))


def icepop_weight(old_logp: torch.Tensor, rollout_logp: torch.Tensor, band: tuple[float, float]) -> torch.Tensor:
    """IcePop's per-token weight rho_t [a <= rho_t <= b] (module docstring; no gradient). Zero
    exactly where a token is masked, since rho_t > 0 (the masked count is where it is 0)."""
    rho = _ratio(old_logp, rollout_logp)
    return torch.where((rho >= band[0]) & (rho <= band[1]), rho, 0.0)


def mis_mask(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, band: tuple[float, float]
) -> torch.Tensor:
    """[a <= exp(mean_t log rho_t) <= b] per sample, broadcast over its tokens (float [B, R])."""
    m = mask.to(old_logp.dtype)
    log_rho = ((old_logp - rollout_logp).detach() * m).sum(-1) / m.sum(-1).clamp(min=1)
    rho = torch.exp(log_rho.clamp(-20, 20))
    keep = (rho >= band[0]) & (rho <= band[1])
    return keep.to(old_logp.dtype)[:, None].expand_as(old_logp)
