"""The megatron backend's core attention: torch's ``scaled_dot_product_attention`` in the place
of mcore's local ``DotProductAttention`` in the local layer spec, which this backend builds on
every device (it needs no TransformerEngine).

    context = softmax(Q K^T / sqrt(head_dim) + causal) V, per head; query head h reads key
    group h // (heads / groups) (mcore's and HF's ``repeat_interleave`` of the groups)

mcore's local module computes it unfused: the scores and the probabilities [b, heads, s, s],
each in the compute dtype, from an explicit [b, 1, s, s] mask. For the paper's Qwen3-30B-A3B
(32 heads, bf16, configs/paper_qwen3_moe_30b.yaml) at its 10,240 tokens that is 32 x 10,240² x
2 bytes = 6.7 GB of scores per layer and sample, and as much for the probabilities; at 32 k
tokens 69 GB each. SDPA with ``is_causal`` and no mask runs flash or memory-efficient kernels
(CUDA's, and the CPU's flash kernel): the working set grows as s, not s².

Invariant that makes the causal mask alone exact: the engine right-pads every row
(``MegatronEngine._logits``), so a query at a valid position t sees keys 0..t, all valid, as
under the explicit mask. Padded positions' outputs differ from the mask's and nothing reads
them: log-probs and losses take valid positions only, attention is causal, and MoE layers run
without a capacity limit, so a padded token never displaces a valid one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SdpaAttention(MegatronModule):
    """mcore's ``CoreAttention`` protocol over ``F.scaled_dot_product_attention``: inputs
    [s, b, heads, head_dim] (keys and values [s, b, groups, head_dim]) of this TP rank, output
    [s, b, heads x head_dim]. No parameters, so checkpoints and the HF mapping are those of the
    local spec. Refuses what it does not compute: another mask type, an explicit mask, dropout,
    sliding windows, softmax offsets, packed sequences, context parallelism."""

    def __init__(  # noqa: PLR0913  (mcore's CoreAttentionBuilder signature)
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = {
            "attn_mask_type": attn_mask_type != AttnMaskType.causal,
            "attention_dropout": dropout != 0.0,
            "window_size": config.window_size is not None,
            "softmax_type": config.softmax_type != "vanilla",
            "context_parallel_size": config.context_parallel_size != 1,
        }
        if any(unsupported.values()):
            names = ", ".join(k for k, bad in unsupported.items() if bad)
            raise ValueError(f"the megatron backend's SDPA core attention computes causal attention only; got {names}")
        head_dim = config.kv_channels
        # mcore's apply_query_key_layer_scaling divides the scores by the layer number and its
        # softmax multiplies them back: the same softmax scale
        self.scale = softmax_scale if softmax_scale is not None else head_dim**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "the SDPA core attention takes right-padded rows with no explicit mask (the causal mask is "
                "exact at every valid position); pass attention_mask=None"
            )
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise ValueError(f"the SDPA core attention is causal, asked for {attn_mask_type}")
        s, b, heads, head_dim = query.shape
        if key.shape[0] != s:
            raise ValueError(f"the SDPA core attention attends over the whole row: {s} queries, {key.shape[0]} keys")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, head_dim]
        per_group = heads // k.shape[1]
        if per_group > 1:
            k, v = (t.repeat_interleave(per_group, dim=1) for t in (k, v))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return context.permute(2, 0, 1, 3).reshape(s, b, heads * head_dim)
