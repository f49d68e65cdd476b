"""GRPO/DAPO/PPO building blocks as pure functions over tensors. Shapes: B samples, R response
positions; ``mask`` [B, R] is 1 on real response tokens. Formulas in each docstring."""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantage per sample (samples of a prompt are contiguous):
    A_i = (r_i - mean_g(r)) / (std_g(r) + eps) with the unbiased group std, or
    A_i = r_i - mean_g(r) without std normalisation (Dr. GRPO)."""
    r = rewards.reshape(-1, group_size).to(torch.float64)
    centred = r - r.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (r.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centred.reshape(-1).to(rewards.dtype)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 for L <= SL - buffer, then linearly down to -factor at
    L = SL: penalty = -factor * (L - (SL - buffer)) / buffer."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_length - buffer)).clamp(min=0)
    return -factor * (over / buffer).clamp(max=1.0)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimators with log r = ref_logp - logp (Schulman's k1..k3):
    k1 = -log r, k2 = (log r)^2 / 2, k3 = exp(log r) - 1 - log r (non-negative, low variance)."""
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        log_r = log_r.clamp(-20, 20)
        return torch.exp(log_r) - 1 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}")


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens where ``mask`` is 1 (token
    rewards [B, R]): with t' the next masked-in position after t,
    delta_t = r_t + gamma V_t' - V_t,  A_t = delta_t + gamma lam A_t',  returns = A + V,
    V and A zero past the last one. Positions where ``mask`` is 0 are skipped, not ends: a
    multi-turn response's inserted tool tokens are not steps of the policy, so its sampled
    tokens are one sequence of steps (the same as GAE over them compressed, tested); A and the
    returns there are 0."""
    m = mask.bool()
    adv = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    next_v = torch.zeros_like(last)
    for t in reversed(range(values.shape[1])):
        step = rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * last
        last = torch.where(m[:, t], step, last)
        next_v = torch.where(m[:, t], values[:, t], next_v)
        adv[:, t] = step * m[:, t]
    return adv, adv + values * m


def token_rewards(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    width: int,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO's per-token rewards [B, width]: the sequence score at the last sampled response token
    (index L_b - 1, or with ``mask`` [B, width] of the sampled tokens the last index where it is
    1), minus ``kl_coef`` x the per-token KL when KL is in the reward (verl
    ``apply_kl_penalty``): r_t = -beta kl_t + [t = last] score. A multi-turn trajectory can end on
    inserted tokens (after a prefix break); GAE and the returns skip those, so a score there
    would be lost."""
    out = torch.zeros(scores.shape[0], width, dtype=torch.float64)
    if kl is not None:
        out -= kl_coef * kl.to(torch.float64)
    last = lengths.long() - 1
    if mask is not None:
        sampled = torch.where(mask.bool(), torch.arange(width).expand(mask.shape[0], width), -1).max(dim=1).values
        last = torch.where(sampled >= 0, sampled, last)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    out[rows, last[rows]] += scores[rows].to(torch.float64)
    return out


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """(count, sum, sum of squares) of the masked entries, to be summed over ranks before
    ``whiten`` so that the statistics are those of the whole batch, however it is split."""
    m = mask.to(torch.float64)
    x = x.to(torch.float64)
    return float(m.sum()), float((x * m).sum()), float((x * x * m).sum())


def whiten(
    x: torch.Tensor, mask: torch.Tensor, count: float, total: float, total_sq: float, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) on masked entries, 0 elsewhere, with the batch's mean and
    unbiased variance from its global moments (verl ``masked_whiten``):
    mean = S / n, var = (Q - n mean^2) / (n - 1)."""
    mean = total / max(count, 1.0)
    var = max(total_sq - count * mean * mean, 0.0) / max(count - 1.0, 1.0)
    return (x.to(torch.float64) - mean) / (var + eps) ** 0.5 * mask.to(torch.float64)
