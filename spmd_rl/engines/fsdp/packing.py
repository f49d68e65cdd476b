"""Padding-free micro-batches: a right-padded ``SeqBatch`` packed into fewer rows (the
"padding-free sequences" lever of docs/benchmarks.md).

Layout. With L_b = the length of sample b (prompt + response) and W = max_b L_b, samples are
placed longest first into rows of width W, each into the first row that still has room (first
fit decreasing), at column offset o_b of row r_b. ``position_ids`` restart at 0 for every
sample, so HF's mask builder (``masking_utils.find_packed_sequence_indices``: a new sequence
starts wherever the position does not grow by one) gives each sample a causal mask of its own
tokens only. A row's free tail continues the positions of its last sample, so it is causal
after it and changes nothing it attends to; nothing reads its outputs.

Flash attention. HF's flash path finds packed samples from ``position_ids`` only when the batch
has one row (it then runs flash-attn's varlen kernel with the samples' boundaries); with more
rows it would attend across the samples of a row. So a model whose attention is a flash
implementation gets every sample in one row (``one_row``), and a flash forward over more than
one packed row is refused. SDPA and eager attention take HF's block-diagonal 4-D mask, built
from the same position restarts, over rows of width W.

Invariant (tested against the padded forward and float64): for every real response token j
of sample b, the packed log-prob is that of position o_b + P_b + j - 1 of row r_b, and it
equals the padded forward's log-prob up to float rounding; the gradient is the same. The LM
head runs only on the N real response-predicting positions (a pre-hook on ``lm_head`` selects
them), so the logits are [N, V] with N = the micro-batch's response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spmd_rl.engines.training.logprobs import SeqBatch
from spmd_rl.engines.training.token_logprob import SamplingPolicy, token_logprob


@dataclass
class Packed:
    input_ids: torch.Tensor  # [rows, W]
    position_ids: torch.Tensor  # [rows, W]
    flat_predictor: torch.Tensor  # [N] index into the flattened [rows * W] of each real response token's predictor
    targets: torch.Tensor  # [N] the response token each predicts
    last: torch.Tensor  # [B] flat index of each sample's last token


def place(lengths: list[int], one_row: bool = False) -> tuple[int, list[tuple[int, int]]]:
    """(width W, (row, offset) of each sample): first fit decreasing into rows of width
    W = max length; rows are filled in the order they are opened. ``one_row``: W = the sum of
    the lengths, so every sample lands in row 0."""
    width = (sum(lengths) if one_row else max(lengths, default=1)) or 1
    free: list[int] = []  # room left in each row
    where: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for b in sorted(range(len(lengths)), key=lambda b: -lengths[b]):
        row = next((r for r, room in enumerate(free) if room >= lengths[b]), len(free))
        if row == len(free):
            free.append(width)
        where[b] = (row, width - free[row])
        free[row] -= lengths[b]
    return width, where


def flash_attention(model: torch.nn.Module) -> bool:
    """Whether the model's attention is a flash implementation (module docstring)."""
    return "flash" in str(getattr(model.config, "_attn_implementation", "") or "")


def pack(batch: SeqBatch, one_row: bool = False) -> Packed:
    """The packed layout of ``batch`` (module docstring); nothing is copied per token in Python."""
    lengths = batch.attention_mask.sum(1).tolist()
    width, where = place(lengths, one_row)
    rows = 1 + max((r for r, _ in where), default=0)
    ids = torch.full((rows, width), int(batch.input_ids[0, 0]) if len(batch) else 0, dtype=batch.input_ids.dtype)
    pos = torch.arange(width).repeat(rows, 1)
    for b in sorted(range(len(where)), key=lambda b: where[b]):  # left to right in each row
        (r, o), n = where[b], lengths[b]
        ids[r, o : o + n] = batch.input_ids[b, :n]
        pos[r, o:] = torch.arange(width - o)  # restarts here; a free tail continues it
    start = torch.tensor([r * width + o for r, o in where], dtype=torch.long)
    flat_predictor = (start[:, None] + batch.predictor)[batch.mask]
    return Packed(
        ids, pos, flat_predictor, batch.targets[batch.mask], start + torch.tensor(lengths, dtype=torch.long) - 1
    )


def packed_for(model: torch.nn.Module, batch: SeqBatch) -> Packed:
    """``pack`` in the layout the model's attention keeps apart (module docstring)."""
    p = pack(batch, one_row=flash_attention(model))
    if flash_attention(model) and p.input_ids.shape[0] > 1:  # cannot happen with one_row; the guard is the invariant
        raise RuntimeError("flash attention over more than one packed row would attend across samples")
    return p


def _on(p: Packed, device: torch.device) -> Packed:
    return Packed(*(t.to(device) for t in (p.input_ids, p.position_ids, p.flat_predictor, p.targets, p.last)))


def _packed_head(
    model: torch.nn.Module, head: torch.nn.Module, batch: SeqBatch, device: torch.device
) -> tuple[torch.Tensor, Packed, torch.Tensor]:
    """(``head``'s outputs [N, out] at the N response-predicting positions, the layout on
    ``device``, the mask on ``device``): the model runs once on the packed rows, and a
    pre-hook hands ``head`` only the hidden states of those positions."""
    p = _on(packed_for(model, batch), device)

    def select(_module, args):  # [rows, W, H] -> [1, N, H]
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1])[p.flat_predictor][None],) + tuple(args[1:])

    hook = head.register_forward_pre_hook(select)
    try:
        out = model(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=None, use_cache=False).logits[0]
    finally:
        hook.remove()
    return out, p, batch.mask.to(device)


def _unflatten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] values of the mask's True entries (row-major) -> [B, R], 0 elsewhere; differentiable."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=mask.device).masked_scatter(mask, values)


def packed_response_logprobs(
    model: torch.nn.Module,
    batch: SeqBatch,
    with_entropy: bool = False,
    policy: SamplingPolicy = SamplingPolicy(),
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logprobs.lm_response_logprobs`` computed on the packed layout of ``batch`` (host
    tensors; the model runs on ``device``): (log-probs [B, R], entropies [B, R] or None) on
    ``device``, 0 where masked."""
    logits, p, mask = _packed_head(model, model.lm_head, batch, device or batch.input_ids.device)
    lp, ent = token_logprob(logits, p.targets, policy, with_entropy)
    return _unflatten(lp, mask), _unflatten(ent, mask) if with_entropy else None


def packed_values(model: torch.nn.Module, batch: SeqBatch, device: torch.device | None = None) -> torch.Tensor:
    """A value-head model's (``AutoModelForTokenClassification``, one label) values [B, R] of
    the states predicting each response token, on the packed layout; 0 where masked."""
    values, _, mask = _packed_head(model, model.score, batch, device or batch.input_ids.device)
    return _unflatten(values[:, 0].float(), mask)


def packed_scores(model: torch.nn.Module, batch: SeqBatch, device: torch.device | None = None) -> torch.Tensor:
    """A reward model's (``AutoModelForSequenceClassification``, one label) scores [B]: the
    head at each sample's last token, on the packed layout. The head runs on every packed
    position (one output each) and is read at the last tokens; the model's own pooling, which
    assumes one sample per row, is not used."""
    p = _on(packed_for(model, batch), device or batch.input_ids.device)
    seen: list[torch.Tensor] = []
    hook = model.score.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        model(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=None, use_cache=False)
    finally:
        hook.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])[p.last, 0].float()
