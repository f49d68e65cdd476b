"""Fused, chunked per-token log-prob and entropy (issue 12's "fused log-prob" lever).

For rows x = logits[n] / T in float32 (n = 1..N) and targets t_n:

    lse_n = log sum_v exp(x_nv)
    lp_n  = x_{n t_n} - lse_n
    ent_n = lse_n - sum_v p_nv x_nv,      p_nv = exp(x_nv - lse_n)

Forward and backward walk the rows ``chunk`` at a time and save only the logits (no copy),
the targets, lse and ent: no [N, V] float32 tensor is ever whole, however large the vocabulary
(an unfused log_softmax keeps a float32 copy of every [N, V] it sees for its backward). The
backward recomputes p per chunk:

    d lp_n  / d x_nv = 1[v = t_n] - p_nv
    d ent_n / d x_nv = -p_nv (x_nv - (lse_n - ent_n))       (lse_n - ent_n = E_p[x_n])

and d / d logits = (d / d x) / T, returned in the logits' dtype.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24  # float32 temporaries of at most 64 MiB per chunk


def _rows(n: int, vocab: int, chunk_elements: int) -> range:
    return range(0, n, max(1, chunk_elements // max(1, vocab)))


class _TokenLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, chunk_elements):
        n, vocab = logits.shape
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if with_entropy else lp.new_empty(0)
        step = max(1, chunk_elements // max(1, vocab))
        for s in _rows(n, vocab, chunk_elements):
            x = logits[s : s + step].float()
            if temperature != 1.0:
                x = x / temperature
            m = torch.logsumexp(x, dim=-1)
            lse[s : s + step] = m
            lp[s : s + step] = x.gather(-1, targets[s : s + step, None]).squeeze(-1) - m
            if with_entropy:
                ent[s : s + step] = m - (torch.exp(x - m[:, None]) * x).sum(-1)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature, ctx.with_entropy, ctx.chunk_elements = temperature, with_entropy, chunk_elements
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        n, vocab = logits.shape
        grad = torch.empty_like(logits)
        step = max(1, ctx.chunk_elements // max(1, vocab))
        use_ent = ctx.with_entropy and g_ent is not None
        for s in _rows(n, vocab, ctx.chunk_elements):
            x = logits[s : s + step].float()
            if ctx.temperature != 1.0:
                x = x / ctx.temperature
            p = torch.exp(x - lse[s : s + step, None])
            gl = g_lp[s : s + step, None].float() if g_lp is not None else torch.zeros_like(lse[s : s + step, None])
            gx = -p * gl
            gx.scatter_add_(-1, targets[s : s + step, None], gl)
            if use_ent:
                mean_x = (lse[s : s + step] - ent[s : s + step])[:, None]
                gx -= g_ent[s : s + step, None].float() * p * (x - mean_x)
            if ctx.temperature != 1.0:
                gx /= ctx.temperature
            grad[s : s + step] = gx.to(grad.dtype)
        return grad, None, None, None, None


def token_logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
                  chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lp, ent or None), float32, of shape ``logits.shape[:-1]``, for logits [..., V] (any
    float dtype) and int64 targets [...]; differentiable in ``logits`` (module docstring)."""
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    lp, ent = _TokenLogProb.apply(flat, targets.reshape(-1), float(temperature), with_entropy, chunk_elements)
    return lp.view(shape), ent.view(shape) if with_entropy else None
