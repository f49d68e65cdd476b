"""The DPO graph's own stages (``recipe.graph.dpo_stages``): ``preference_pairs`` writes each
pair's responses from the dataset (sample 2q is prompt q's chosen response, 2q + 1 its rejected
one), ``dpo_update`` trains the registered preference loss (``algos.preference``) over whole
pairs.

Invariant (tested): one optimizer step's gradient is that of the mean loss over the
mini-batch's pairs, whatever the micro-batch size and the DP layout: every micro-batch sums
its pairs' losses and divides by the mini-batch's global pair count (times the DP size, which
FSDP's gradient average divides out again)."""

from __future__ import annotations

import torch

from spmd_rl.algos.preference import get_preference_loss
from spmd_rl.recipe.graph import algorithm
from spmd_rl.trainer.stages.policy_objective import on_host
from spmd_rl.trainer.stages.minibatch import dp_sums
from spmd_rl.trainer.stages.registry import StageCall, StageResult, register
from spmd_rl.trainer.stages.samples import seq_batch

_SUMS = ("loss", "pairs", "chosen_reward", "rejected_reward", "correct")


@register("preference_pairs")
def preference_pairs(call: StageCall) -> StageResult:
    """Sample i's response: the chosen (i even) or rejected (i odd) tokens of its pair;
    ``prompt_row`` is the sampler's position in the loaded set (``put_prompts``)."""
    pairs = call.view.prompts.pairs
    out = [
        torch.tensor(pairs[int(row)][int(i) % 2], dtype=torch.int32)
        for i, row in zip(call.batch.indices, call.batch.columns["prompt_row"])
    ]
    return StageResult(columns={"response_ids": out})


def pair_order(indices) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in the batch of each pair's chosen and rejected sample, pairs in index order."""
    where = {int(i): p for p, i in enumerate(indices)}
    groups = sorted({i // 2 for i in where})
    missing = [q for q in groups if 2 * q not in where or 2 * q + 1 not in where]
    if missing:
        raise RuntimeError(f"dpo_update got half of the pairs {missing[:5]}: the stage must be group-granular")
    return torch.tensor([where[2 * q] for q in groups]), torch.tensor([where[2 * q + 1] for q in groups])


@register("dpo_update")
def dpo_update(call: StageCall) -> StageResult:
    """Epochs over mini-batches of ``actor.mini_batch_size`` pairs (over all DP ranks), one
    optimizer step each, in micro-batches of ``actor.micro_batch_size // 2`` pairs (at least 1)."""
    view, batch = call.view, call.batch
    cfg, lay, a = view.cfg, view.lay.train, view.cfg.actor
    chosen, rejected = pair_order(batch.indices)
    interleaved = torch.stack([chosen, rejected], 1).reshape(-1)  # c0 r0 c1 r1 ...
    seqs = seq_batch(view, batch)[interleaved]
    ref = (
        torch.stack([batch.columns["ref_log_prob"][int(p)].double().sum() for p in interleaved]).float().reshape(-1, 2)
        if len(batch)
        else torch.zeros(0, 2)
    )
    loss_of = get_preference_loss(algorithm(cfg).estimator)
    beta, eps = cfg.algorithm.dpo_beta, cfg.algorithm.dpo_label_smoothing
    per_rank = a.mini_batch_size // lay.dp
    micro = max(1, a.micro_batch_size // 2)
    n = len(chosen)
    acc = dict.fromkeys(_SUMS, 0.0)
    steps, grad_norm, lr = 0, 0.0, 0.0
    for epoch in range(a.ppo_epochs):
        for start in range(0, n, per_rank):
            pairs = range(start, min(start + per_rank, n))
            total = dp_sums({"pairs": float(len(pairs))}, lay.group, view.group)["pairs"]
            micros = [range(s, min(s + micro, pairs.stop)) for s in range(pairs.start, pairs.stop, micro)]

            def loss_fn(lp, ent, k, micros=micros, total=total, first=epoch == 0):
                span = micros[k]
                mask = seqs.mask[2 * span.start : 2 * span.stop].to(lp.device)
                seq_lp = (lp * mask).sum(1).reshape(-1, 2)
                r = ref[span.start : span.stop].to(lp.device)
                terms = loss_of(seq_lp[:, 0], seq_lp[:, 1], r[:, 0], r[:, 1], beta, eps)
                if first:
                    acc["loss"] += terms.loss.detach().sum()
                    acc["pairs"] += float(len(span))
                    acc["chosen_reward"] += terms.chosen_reward.sum()
                    acc["rejected_reward"] += terms.rejected_reward.sum()
                    acc["correct"] += (terms.chosen_reward > terms.rejected_reward).sum()
                return terms.loss.sum() / total * lay.dp  # FSDP averages gradients over dp_shard: undo it

            out = view.roles["actor"].train_step([seqs[2 * s.start : 2 * s.stop] for s in micros], loss_fn)
            grad_norm, lr, steps = grad_norm + out["grad_norm"], out["lr"], steps + 1
    view.weights_changed()
    g = dp_sums(on_host(acc), lay.group, view.group)
    p = max(g["pairs"], 1.0)
    consumed = [(int(i), int(r)) for i, r in zip(batch.indices, batch.columns["prompt_row"])]
    return StageResult(
        consumed=consumed,
        final={
            "loss": g["loss"] / p,
            "grad_norm": grad_norm / max(steps, 1),
            "lr": lr,
            "dpo_chosen_reward": g["chosen_reward"] / p,
            "dpo_rejected_reward": g["rejected_reward"] / p,
            "dpo_margin": (g["chosen_reward"] - g["rejected_reward"]) / p,
            "dpo_accuracy": g["correct"] / p,
        },
    )
