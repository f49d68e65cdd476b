"""Advantage estimators without a critic, registered by name (``algorithm.name``), as pure
functions over float64 tensors. Samples of a prompt are contiguous groups of N.

Sequence-level (one scalar per sample, the same for every token):

- ``grpo`` / ``dapo``: group-normalised reward (``core.grpo_advantages``);
- ``rloo`` (Ahmadian et al. 2024, REINFORCE Leave-One-Out): the baseline of sample i is the
  mean reward of the other N - 1 samples of its prompt:
  A_i = r_i - (sum_g r - r_i) / (N - 1) = N / (N - 1) (r_i - mean_g r).

Token-level (REINFORCE++, Hu 2025), per-token rewards r_t = -beta kl_t + [t = L - 1] s with
the KL in the reward when ``algorithm.use_kl_loss`` is false (``core.token_rewards``):

- ``reinforce_pp``: s = the reward; returns G_t = sum_{k >= t} gamma^(k - t) r_k over the
  sampled tokens (inserted tool tokens skipped, as GAE does; ``TOKEN_ESTIMATORS["returns"]``);
- ``reinforce_pp_baseline``: s = the reward minus its prompt group's mean (the spec's
  ``centre_scores``), then the same returns;

a user's token estimator (``module:function``, ``TokenEstimator``'s signature) replaces the
returns; then A = (G - mean) / std with the mean and variance of *every* token of the iteration's batch
(global batch normalisation: moments summed over the data-parallel ranks, ``core.whiten``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spmd_rl.algos.core import grpo_advantages
from spmd_rl.catalog import Registry

SeqEstimator = Callable[[torch.Tensor, int, bool], torch.Tensor]
"""(rewards [B] float64, group size N, norm_adv_by_std) -> advantages [B]."""
SEQ_ESTIMATORS: Registry[SeqEstimator] = Registry("sequence advantage estimator")
TokenEstimator = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(token rewards [B, T] float64, mask [B, T] bool of the sampled tokens, algorithm.gamma) ->
per-token advantages [B, T] before the batch whitening, 0 where the mask is 0."""
TOKEN_ESTIMATORS: Registry[TokenEstimator] = Registry("token advantage estimator")


@SEQ_ESTIMATORS.register("grpo", "dapo")
def grpo(rewards: torch.Tensor, group_size: int, norm_by_std: bool) -> torch.Tensor:
    return grpo_advantages(rewards, group_size, norm_by_std)


@SEQ_ESTIMATORS.register("rloo")
def rloo(rewards: torch.Tensor, group_size: int, norm_by_std: bool = False) -> torch.Tensor:
    """A_i = r_i - mean of the other samples' rewards of the prompt (module docstring)."""
    r = rewards.reshape(-1, group_size).to(torch.float64)
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - others).reshape(-1)


def group_centred(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """r_i - mean_g r (REINFORCE++-baseline's score)."""
    r = rewards.reshape(-1, group_size).to(torch.float64)
    return (r - r.mean(dim=1, keepdim=True)).reshape(-1)


@TOKEN_ESTIMATORS.register("returns")
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_t' over the positions where ``mask`` is 1 (t' the next one; the
    others are skipped, not ends), 0 where it is 0."""
    m = mask.bool()
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(m[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = running * m[:, t]
    return out
