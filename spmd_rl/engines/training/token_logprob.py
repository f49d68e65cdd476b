"""Fused, chunked per-token log-prob and entropy (the "fused log-prob" lever) of the
policy vLLM samples from.

The sampling policy (``SamplingPolicy``: temperature T, top-k, top-p) is vLLM's: x = logits / T
in float32, then top-k keeps the tokens whose x is at least the k-th largest (ties kept), then
top-p sorts the kept x ascending and drops every token whose cumulative probability (from the
smallest) is <= 1 - p, always keeping the largest (``vllm/v1/sample/ops/topk_topp_sampler.py``
``apply_top_k_top_p_pytorch``; HF's TopK/TopP warpers do the same). K_n is the kept set of row
n, plus the target t_n (vLLM sampled it, so it was in vLLM's set; a tie at the boundary under
other rounding must not give -inf). With K_n = all tokens when neither is on:

    lse_n = log sum_{v in K_n} exp(x_nv)
    lp_n  = x_{n t_n} - lse_n
    ent_n = lse_n - sum_{v in K_n} p_nv x_nv,      p_nv = exp(x_nv - lse_n) on K_n, 0 elsewhere

These are the log-probs vLLM returns with ``logprobs_mode="processed_logprobs"`` (softmax over
the masked logits), so the ratio, TIS weight and KL compare one distribution on both sides. The
set K_n is a selection, not a function of the weights: gradients flow through the kept logits.

Forward and backward walk the rows ``chunk`` at a time and save only the logits (no copy),
the targets, lse and ent: no [N, V] float32 tensor is ever whole, however large the vocabulary
(an unfused log_softmax keeps a float32 copy of every [N, V] it sees for its backward). The
backward recomputes p per chunk:

    d lp_n  / d x_nv = 1[v = t_n] - p_nv
    d ent_n / d x_nv = -p_nv (x_nv - (lse_n - ent_n))       (lse_n - ent_n = E_p[x_n])

and d / d logits = (d / d x) / T, returned in the logits' dtype. The kept set is recomputed
per chunk in the backward (a sort per row when top-p is on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_ELEMENTS = 1 << 24  # float32 temporaries of at most 64 MiB per chunk


@dataclass(frozen=True)
class SamplingPolicy:
    """What the rollout sampled with; T = 0 (greedy) counts as T = 1 with no truncation."""

    temperature: float = 1.0
    top_k: int = -1
    """-1 (or 0): off."""
    top_p: float = 1.0

    @classmethod
    def of(cls, rollout) -> "SamplingPolicy":
        """From ``RolloutConfig`` (vLLM gets top-k / top-p only when T > 0: ``engines.vllm.engine``)."""
        if rollout.temperature <= 0:
            return cls()
        return cls(rollout.temperature, rollout.top_k, rollout.top_p)


def kept(x: torch.Tensor, targets: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Boolean [n, V]: the sampling set K_n of each row of x = logits / T (module docstring)."""
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.shape[-1]:
        keep = x >= x.topk(top_k, dim=-1).values[:, -1:]
    if top_p < 1.0:
        xs, order = x.masked_fill(~keep, float("-inf")).sort(dim=-1)
        drop = xs.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False
        keep &= ~torch.zeros_like(keep).scatter_(-1, order, drop)
    return keep.scatter_(-1, targets[:, None], True)


def _policy_rows(logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """x = logits / T in float32 and the kept set (None: every token)."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    return x, (kept(x, targets, top_k, top_p) if top_k > 0 or top_p < 1.0 else None)


def _rows(n: int, vocab: int, chunk_elements: int) -> range:
    return range(0, n, max(1, chunk_elements // max(1, vocab)))


class _TokenLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, chunk_elements, top_k, top_p):
        n, vocab = logits.shape
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if with_entropy else lp.new_empty(0)
        step = max(1, chunk_elements // max(1, vocab))
        for s in _rows(n, vocab, chunk_elements):
            t = targets[s : s + step]
            x, keep = _policy_rows(logits[s : s + step], t, temperature, top_k, top_p)
            m = torch.logsumexp(x if keep is None else x.masked_fill(~keep, float("-inf")), dim=-1)
            lse[s : s + step] = m
            lp[s : s + step] = x.gather(-1, t[:, None]).squeeze(-1) - m
            if with_entropy:
                px = torch.exp(x - m[:, None]) * x
                ent[s : s + step] = m - (px if keep is None else px.masked_fill(~keep, 0.0)).sum(-1)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature, ctx.with_entropy, ctx.chunk_elements = temperature, with_entropy, chunk_elements
        ctx.top_k, ctx.top_p = top_k, top_p
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        n, vocab = logits.shape
        grad = torch.empty_like(logits)
        step = max(1, ctx.chunk_elements // max(1, vocab))
        use_ent = ctx.with_entropy and g_ent is not None
        for s in _rows(n, vocab, ctx.chunk_elements):
            x, keep = _policy_rows(logits[s : s + step], targets[s : s + step], ctx.temperature, ctx.top_k, ctx.top_p)
            p = torch.exp(x - lse[s : s + step, None])
            if keep is not None:
                p = p.masked_fill_(~keep, 0.0)
            gl = g_lp[s : s + step, None].float() if g_lp is not None else torch.zeros_like(lse[s : s + step, None])
            gx = -p * gl
            gx.scatter_add_(-1, targets[s : s + step, None], gl)
            if use_ent:
                mean_x = (lse[s : s + step] - ent[s : s + step])[:, None]
                gx -= g_ent[s : s + step, None].float() * p * (x - mean_x)
            if ctx.temperature != 1.0:
                gx /= ctx.temperature
            grad[s : s + step] = gx.to(grad.dtype)
        return grad, None, None, None, None, None, None


def token_logprob(
    logits: torch.Tensor,
    targets: torch.Tensor,
    policy: SamplingPolicy = SamplingPolicy(),
    with_entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lp, ent or None), float32, of shape ``logits.shape[:-1]``, for logits [..., V] (any
    float dtype) and int64 targets [...] under ``policy``; differentiable in ``logits`` (module
    docstring)."""
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    lp, ent = _TokenLogProb.apply(
        flat,
        targets.reshape(-1),
        float(policy.temperature),
        with_entropy,
        chunk_elements,
        int(policy.top_k),
        float(policy.top_p),
    )
    return lp.view(shape), ent.view(shape) if with_entropy else None
