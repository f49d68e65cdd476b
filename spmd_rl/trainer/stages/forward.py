"""The forward-only stages, one engine each: ``ref_logprob`` (the reference's per-token
log-probs), ``actor_logprob`` (the actor's own, before the update: the off-policy ratio's
denominator and KL-in-reward's policy side) and ``critic_value`` (PPO's per-token values)."""

from __future__ import annotations

import torch

from spmd_rl.recipe.graph import ref_micro_batch_size
from spmd_rl.trainer.stages.micro import micro_plan
from spmd_rl.trainer.stages.minibatch import length_order, mini_batches
from spmd_rl.trainer.stages.registry import StageCall, StageResult, register
from spmd_rl.trainer.stages.samples import ragged, seq_batch

ENGINE_OF = {"ref_logprob": "ref", "actor_logprob": "actor", "critic_value": "critic"}


@register(*ENGINE_OF)
def forward_stage(call: StageCall) -> StageResult:
    view, batch = call.view, call.batch
    if not len(batch):
        return StageResult()
    role = ENGINE_OF[call.stage.name]
    micro = ref_micro_batch_size(view.cfg) if role == "ref" else view.cfg.actor.micro_batch_size
    seqs = seq_batch(view, batch)
    order = length_order(
        view.cfg, view.lay.train.dp, seqs.attention_mask.sum(1)
    )  # the updates' order and micro-batches
    seqs = seqs[order]
    plan = micro_plan(
        view.cfg, seqs.attention_mask.sum(1), mini_batches(view.cfg, view.lay.train.dp, len(batch)), micro, view.group
    )
    got, _ = view.roles[role].infer([seqs[s] for mini in plan for s in mini])
    out = torch.empty_like(got)
    out[order] = got
    (column,) = call.stage.outputs
    return StageResult(columns={column: ragged(out, [r.numel() for r in batch.columns["response_ids"]])})
