"""MoE router objectives, written as sums over tokens with global normalisers so that the
micro-batch and data-parallel split of a mini-batch does not change them.

Load balancing (Switch Transformer; Qwen3-MoE's ``router_aux_loss_coef`` term), per layer l of
L, with E experts, top-k routing, p[t, e] = softmax(router logits of token t)[e]:

    L_lb = (1 / L) sum_l E sum_e f[l, e] P[l, e],   P[l, e] = (1 / T) sum_t p[l, t, e]
    f[l, e] = (routed slots of layer l to expert e) / (k x routed tokens)

f carries no gradient (it counts a top-k); it is the mini-batch's, counted from the routes
before the update (``load_fractions``), and T counts the mini-batch's real tokens over every
DP rank, so L_lb = sum over tokens of ``load_balance_terms`` and each micro-batch adds its own
tokens' part. Uniform routing gives L_lb = 1, its minimum.

Router z-loss (ST-MoE): L_z = (1 / L) sum_l (1 / T) sum_t logsumexp(logits[l, t])^2.
"""

from __future__ import annotations

import torch


def load_fractions(routes: list[torch.Tensor], experts: int) -> torch.Tensor:
    """Routed-slot counts [layers, experts] (float64) of samples' routes ([positions, layers,
    k] each); divide by their row sums for f."""
    if not routes:
        return torch.zeros(0, experts, dtype=torch.float64)
    layers = routes[0].shape[1]
    out = torch.zeros(layers, experts, dtype=torch.float64)
    for r in routes:
        flat = r.long().permute(1, 0, 2).reshape(layers, -1)  # [layers, positions x k]
        out.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float64))
    return out


def load_balance_terms(
    probs: torch.Tensor, valid: torch.Tensor, fraction: torch.Tensor, tokens: float, layers: int
) -> torch.Tensor:
    """This forward's part of L_lb from one layer: E / (L T) sum_{t valid} sum_e f[e] p[t, e]
    (``probs`` [N, E], ``fraction`` f [E] of the layer)."""
    experts = probs.shape[1]
    return experts / (layers * tokens) * (probs.float()[valid] @ fraction.to(probs.device, torch.float32)).sum()


def z_loss_terms(logits: torch.Tensor, valid: torch.Tensor, tokens: float, layers: int) -> torch.Tensor:
    """This forward's part of L_z from one layer: (1 / (L T)) sum_{t valid} logsumexp(logits[t])^2."""
    return torch.logsumexp(logits.float()[valid], dim=-1).square().sum() / (layers * tokens)
