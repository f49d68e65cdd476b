"""Sequence batches and per-token log-probabilities / entropies of response tokens.

A sample is s = prompt ++ response. In the right-padded batch, response token j of sample b
sits at position P_b + j and is predicted by the logits at P_b + j - 1, so
logprob[b, j] = log_softmax(logits[b, P_b + j - 1] / T)[s_b[P_b + j]] with T the sampling
temperature (the policy that generated the response is softmax(logits / T)); entropy
H[b, j] = -sum_v p_v log p_v of that distribution. Float32 throughout; padded response
positions (j >= R_b) are masked out by ``mask``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqBatch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded
    attention_mask: torch.Tensor  # [B, T]
    predictor: torch.Tensor  # [B, R] position of the logits predicting response token j
    targets: torch.Tensor  # [B, R] response token ids (pad where masked)
    mask: torch.Tensor  # [B, R] bool, True for real response tokens

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.attention_mask, self.predictor, self.targets, self.mask)

    def to(self, device: torch.device) -> "SeqBatch":
        return SeqBatch(*(t.to(device) for t in self._fields()))

    def __getitem__(self, rows: slice) -> "SeqBatch":
        """The samples ``rows`` (a slice over the batch dimension)."""
        return SeqBatch(*(t[rows] for t in self._fields()))

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def split(batch: SeqBatch, size: int) -> list[SeqBatch]:
    """Consecutive micro-batches of at most ``size`` sequences."""
    return [batch[i : i + size] for i in range(0, len(batch), size)]


def build_batch(prompts: list[torch.Tensor], responses: list[torch.Tensor], pad_id: int) -> SeqBatch:
    b = len(prompts)
    plen = torch.tensor([p.numel() for p in prompts])
    rlen = torch.tensor([r.numel() for r in responses])
    t = int((plen + rlen).max())
    r = max(1, int(rlen.max()))
    ids = torch.full((b, t), pad_id, dtype=torch.int64)
    att = torch.zeros((b, t), dtype=torch.int64)
    for k, (p, s) in enumerate(zip(prompts, responses)):
        seq = torch.cat([p.long(), s.long()])
        ids[k, : seq.numel()] = seq
        att[k, : seq.numel()] = 1
    j = torch.arange(r)[None, :]
    mask = j < rlen[:, None]
    pos = (plen[:, None] + j).clamp(max=t - 1)
    predictor = (pos - 1).clamp(min=0)
    targets = torch.where(mask, ids.gather(1, pos), torch.full_like(pos, pad_id))
    return SeqBatch(ids, att, predictor, targets, mask)


def response_logprobs(logits: torch.Tensor, batch: SeqBatch, with_entropy: bool = False,
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [B, R], entropies [B, R] or None) of the response tokens under
    softmax(logits / temperature); 0 where masked."""
    picked = logits.gather(1, batch.predictor[..., None].expand(-1, -1, logits.shape[-1])).float()
    if temperature != 1.0:
        picked = picked / temperature
    logp = torch.log_softmax(picked, dim=-1)
    lp = logp.gather(-1, batch.targets[..., None]).squeeze(-1) * batch.mask
    ent = (-(logp.exp() * logp).sum(-1) * batch.mask) if with_entropy else None
    return lp, ent
