"""critic_update: PPO's clipped value loss (``algos.value_loss``) over the same epochs and
mini-batches as the actor, with the same split-invariant normaliser (``minibatch``), on the
critic's own optimizer (``algorithm.critic_lr``)."""

from __future__ import annotations

from spmd_rl.algos.value_loss import get_value_loss
from spmd_rl.trainer.stages.micro import micro_plan
from spmd_rl.trainer.stages.minibatch import dp_sums, length_order, mini_batch_norm, mini_batches
from spmd_rl.trainer.stages.registry import StageCall, StageResult, register
from spmd_rl.trainer.stages.samples import padded, seq_batch


@register("critic_update")
def critic_update(call: StageCall) -> StageResult:
    view, batch = call.view, call.batch
    cfg, lay = view.cfg, view.lay.train
    seqs = seq_batch(view, batch)
    width = seqs.mask.shape[1]
    old_values, returns = padded(batch.columns["values"], width), padded(batch.columns["returns"], width)
    order = length_order(cfg, lay.dp, seqs.attention_mask.sum(1))  # metrics are sums: no need to undo it
    seqs, old_values, returns = seqs[order], old_values[order], returns[order]
    objective = get_value_loss("clipped")
    minis = mini_batches(cfg, lay.dp, len(batch))
    plan = micro_plan(cfg, seqs.attention_mask.sum(1), minis, cfg.actor.micro_batch_size, view.group)
    acc = {"value_loss": 0.0, "value_clipped": 0.0, "value_tokens": 0.0, "value_err_sq": 0.0}
    steps, grad_norm, lr = 0, 0.0, 0.0
    for _ in range(cfg.actor.ppo_epochs):
        for sl, micros in zip(minis, plan):
            norm = mini_batch_norm(seqs.mask[sl], lay.group, view.group, view.replicas.sum if view.replicas else None)

            def loss_fn(values, _ent, k, micros=micros, norm=norm):
                s = micros[k]
                mask = seqs.mask[s].to(values.device)
                ret = returns[s].to(values.device)
                out = objective(
                    values,
                    old_values[s].to(values.device),
                    ret,
                    mask,
                    cfg.algorithm.value_clip,
                    cfg.actor.loss.loss_agg_mode,
                    norm,
                )
                acc["value_loss"] += float(out.loss.detach())
                acc["value_clipped"] += out.clipped_tokens
                acc["value_tokens"] += float(mask.sum())
                acc["value_err_sq"] += float(((values.detach() - ret).square() * mask).sum())
                return out.loss * lay.dp  # FSDP averages gradients over dp_shard: undo it

            out = view.roles["critic"].train_step([seqs[s] for s in micros], loss_fn)
            grad_norm += out["grad_norm"]
            lr = out["lr"]
            steps += 1
    g = dp_sums(acc, lay.group, view.group)
    tokens = max(g["value_tokens"], 1.0)
    return StageResult(
        final={
            "value_loss": g["value_loss"] / max(steps, 1),
            "value_clip_frac": g["value_clipped"] / tokens,
            "value_mse": g["value_err_sq"] / tokens,
            "critic_grad_norm": grad_norm / max(steps, 1),
            "critic_lr": lr,
        }
    )
