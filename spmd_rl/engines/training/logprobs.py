"""Sequence batches and per-token log-probabilities / entropies of response tokens.

A sample is s = prompt ++ response. In the right-padded batch, response token j of sample b
sits at position P_b + j and is predicted by the logits at P_b + j - 1, so
logprob[b, j] = log pi(s_b[P_b + j] | logits[b, P_b + j - 1]) with pi the sampling policy
(``token_logprob.SamplingPolicy``: softmax(logits / T), renormalised over the top-k / top-p set
when those are on: the distribution vLLM drew the token from); entropy
H[b, j] = -sum_v p_v log p_v of that distribution. Float32 log-softmax whatever the logits'
dtype; padded response positions (j >= R_b) are masked out by ``mask``, and so are a
multi-turn response's inserted tokens (``response_mask`` 0: tool output, turn separators):
every log-prob, ratio, KL, entropy and loss term exists only where the policy sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spmd_rl.engines.training.token_logprob import SamplingPolicy, token_logprob


@dataclass
class SeqBatch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded
    attention_mask: torch.Tensor  # [B, T]
    predictor: torch.Tensor  # [B, R] position of the logits predicting response token j
    targets: torch.Tensor  # [B, R] response token ids (pad where masked)
    mask: torch.Tensor  # [B, R] bool, True for sampled response tokens (real, and not inserted)
    routes: list[torch.Tensor] | None = None
    """The rollout's routes of each sample ([positions, layers, top_k] uint8, positions 0 ..
    P + R - 2), kept on the host; ``engines.training.route_replay`` lays them out per forward."""

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.attention_mask, self.predictor, self.targets, self.mask)

    def to(self, device: torch.device) -> "SeqBatch":
        return SeqBatch(*(t.to(device) for t in self._fields()), self.routes)

    def __getitem__(self, rows: slice | torch.Tensor) -> "SeqBatch":
        """The samples ``rows`` (a slice or an index tensor over the batch dimension)."""
        routes = (
            None
            if self.routes is None
            else (self.routes[rows] if isinstance(rows, slice) else [self.routes[int(i)] for i in rows])
        )
        return SeqBatch(*(t[rows] for t in self._fields()), routes)

    def trim(self) -> "SeqBatch":
        """The same samples without the padding columns no sample of this batch uses: T cut to
        the longest sequence, R to the longest response (right padding, so nothing moves)."""
        t = max(1, int(self.attention_mask.sum(1).max())) if len(self) else 1
        used = self.mask.any(0).nonzero()
        r = int(used.max()) + 1 if used.numel() else 1
        return SeqBatch(
            self.input_ids[:, :t],
            self.attention_mask[:, :t],
            self.predictor[:, :r].clamp(max=t - 1),
            self.targets[:, :r],
            self.mask[:, :r],
            self.routes,
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def split(batch: SeqBatch, size: int) -> list[SeqBatch]:
    """Consecutive micro-batches of at most ``size`` sequences."""
    return [batch[i : i + size] for i in range(0, len(batch), size)]


def build_batch(
    prompts: list[torch.Tensor],
    responses: list[torch.Tensor],
    pad_id: int,
    routes: list[torch.Tensor] | None = None,
    route_shape: tuple[int, int] | None = None,
    sampled: list[torch.Tensor] | None = None,
) -> SeqBatch:
    """The right-padded batch of prompt ++ response; ``routes`` (flattened ``rollout_routes``)
    are reshaped to [positions, *route_shape] (layers, top_k) and checked to cover P + R - 1
    positions; ``sampled`` (a multi-turn rollout's ``response_mask``, 1 where the policy
    sampled) keeps inserted tokens out of ``mask``."""
    if routes is not None:
        routes = [
            _routes_of(r, route_shape, p.numel() + s.numel() - 1, k)
            for k, (r, p, s) in enumerate(zip(routes, prompts, responses))
        ]
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
    if sampled is not None:
        for k, m in enumerate(sampled):
            if m.numel() != int(rlen[k]):
                raise ValueError(
                    f"sample {k}: response_mask has {m.numel()} entries for {int(rlen[k])} response tokens"
                )
            mask[k, : m.numel()] &= m.bool()
    pos = (plen[:, None] + j).clamp(max=t - 1)
    predictor = (pos - 1).clamp(min=0)
    targets = torch.where(mask, ids.gather(1, pos), torch.full_like(pos, pad_id))
    return SeqBatch(ids, att, predictor, targets, mask, routes)


def _routes_of(flat: torch.Tensor, shape: tuple[int, int], positions: int, k: int) -> torch.Tensor:
    if flat.numel() != positions * shape[0] * shape[1]:
        raise ValueError(
            f"sample {k}: rollout_routes holds {flat.numel()} ids, expected {positions} positions x "
            f"{shape[0]} layers x {shape[1]} experts per token"
        )
    return flat.view(positions, *shape)


def logit_window(batch: SeqBatch) -> tuple[int, int]:
    """[lo, hi): the positions whose logits predict a real response token, shared by the
    micro-batch (prompt positions before the shortest prompt's end and the last position never
    are, so the LM head and the log-softmax skip them)."""
    if not bool(batch.mask.any()):
        return 0, 1
    used = batch.predictor[batch.mask]
    return int(used.min()), int(used.max()) + 1


def response_logprobs(
    logits: torch.Tensor,
    batch: SeqBatch,
    with_entropy: bool = False,
    policy: SamplingPolicy = SamplingPolicy(),
    first: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [B, R], entropies [B, R] or None) of the response tokens under the sampling
    ``policy``; 0 where masked. ``logits`` [B, K, V] are those of positions
    first .. first + K - 1 (all T positions by default); the log-softmax is the fused, chunked
    ``token_logprob``, which never holds a whole float32 [B, K, V]."""
    k = logits.shape[1]
    targets = batch.input_ids[:, first + 1 : first + k + 1].to(logits.device)  # the token each position predicts
    if targets.shape[1] < k:  # the last position predicts nothing; any id will do
        targets = torch.nn.functional.pad(targets, (0, k - targets.shape[1]))
    lp_all, ent_all = token_logprob(logits, targets, policy, with_entropy)
    where = (batch.predictor - first).clamp(0, k - 1)
    lp = lp_all.gather(1, where) * batch.mask
    ent = ent_all.gather(1, where) * batch.mask if with_entropy else None
    return lp, ent


def lm_response_logprobs(
    model: torch.nn.Module, batch: SeqBatch, with_entropy: bool = False, policy: SamplingPolicy = SamplingPolicy()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An HF causal LM's response log-probs: the LM head runs only on ``logit_window``
    (``logits_to_keep``), then ``response_logprobs``."""
    lo, hi = logit_window(batch)
    keep = torch.arange(lo, hi, device=batch.input_ids.device)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep).logits
    return response_logprobs(logits, batch, with_entropy, policy, first=lo)
