"""actor_update: the policy objective (``algos.policy_loss``, registered by name) over PPO
epochs and mini-batches; this module only feeds it the right normaliser (``minibatch``: one
objective per mini-batch however it is split)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from spmd_rl.algos import router_loss
from spmd_rl.algos.core import kl_estimate
from spmd_rl.algos.policy_loss import ClipConfig, aggregate, get_policy_loss, tis_weight
from spmd_rl.algos.rollout_correction import icepop_weight, mis_mask
from spmd_rl.config.stages import advantage_column, separated
from spmd_rl.distributed.sides import side_group
from spmd_rl.engines import route_replay
from spmd_rl.trainer.metrics import global_max
from spmd_rl.trainer.stages.micro import micro_plan
from spmd_rl.trainer.stages.minibatch import dp_sums, length_order, mini_batch_norm, mini_batches
from spmd_rl.trainer.stages.registry import StageCall, StageResult, register
from spmd_rl.trainer.stages.samples import padded, seq_batch

_SUMS = (
    "loss",
    "clipped",
    "kl",
    "entropy",
    "tokens",
    "mismatch_sum",
    "mismatch_tokens",
    "rollout_kl",
    "icepop_masked",
    "mis_rejected",
    "seqs",
)


def on_host(sums: dict) -> dict[str, float]:
    """The metric sums, kept on the device through the micro-batches (a ``float()`` each would
    sync the host before every backward), brought to the host in one copy."""
    values = [torch.as_tensor(v).detach().double().reshape(()) for v in sums.values()]
    device = next((v.device for v in values if v.device.type != "cpu"), torch.device("cpu"))
    return dict(zip(sums, torch.stack([v.to(device) for v in values]).cpu().tolist()))


def router_objective(run, seqs, sl: slice) -> route_replay.RouterObjective | None:
    """The mini-batch's router terms (``algos.router_loss``): its real tokens and, with load
    balancing, its load fractions from the rollout's routes, both summed over every DP rank
    (collective over the training side; None when both coefficients are 0)."""
    a = run.cfg.actor
    if not (a.moe_aux_loss_coef or a.moe_z_loss_coef):
        return None
    group, arch = run.lay.train.group, run.arch
    fractions = None
    if a.moe_aux_loss_coef:
        counts = router_loss.load_fractions(seqs[sl].routes or [], arch.num_experts)
        if not counts.numel():
            counts = torch.zeros(arch.num_layers, arch.num_experts, dtype=torch.float64)
        dist.all_reduce(counts, group=side_group())
        fractions = (counts / counts.sum(1, keepdim=True).clamp(min=1.0)).float()
    tokens = dp_sums({"tokens": float(seqs.attention_mask[sl].sum())}, group)["tokens"]
    return route_replay.RouterObjective(
        a.moe_aux_loss_coef, a.moe_z_loss_coef, fractions, max(tokens, 1.0), len(arch.sparse_layers), run.lay.train.dp
    )


@register("actor_update")
def actor_update(call: StageCall) -> StageResult:  # noqa: PLR0915
    """PPO epochs over mini-batches of this rank's share; one optimizer step per mini-batch.
    Reads the columns the stage graph declares (reference / old log-probs when present)."""
    run, batch = call.run, call.batch
    cfg, lay = run.cfg, run.lay.train
    a = cfg.actor
    use_ref, use_old = "ref_log_prob" in call.stage.inputs, "old_log_prob" in call.stage.inputs
    seqs = seq_batch(run, batch)
    width = seqs.mask.shape[1]
    if advantage_column(cfg) == "seq_advantage":  # one scalar per sample, the same for every token
        adv = (
            torch.stack(batch.columns["seq_advantage"]).float()[:, None].expand(-1, width)
            if len(batch)
            else torch.zeros(0, width)
        )
    else:
        adv = padded(batch.columns["advantages"], width)
    rollout = padded(batch.columns["rollout_log_prob"], width)
    ref = padded(batch.columns["ref_log_prob"], width) if use_ref else None
    old = padded(batch.columns["old_log_prob"], width) if use_old else None
    order = length_order(cfg, lay.dp, seqs.attention_mask.sum(1))  # metrics are sums: no need to undo it
    seqs, adv, rollout = seqs[order], adv[order], rollout[order]
    ref, old = (None if t is None else t[order] for t in (ref, old))
    objective = get_policy_loss(a.policy_loss)

    def correction(old_lp, roll, mask, sums):
        """The rollout-correction weight of each token (``algos.rollout_correction``), None when
        every one is off; ``sums`` (the first epoch's) count what IcePop masked and MIS rejected."""
        weights = [tis_weight(old_lp, roll, a.tis_cap)] if a.tis_cap is not None else []
        if a.icepop_band is not None:  # the config refuses it beside TIS: it is the importance weight itself
            weights.append(icepop_weight(old_lp, roll, a.icepop_band))
            if sums is not None:
                sums["icepop_masked"] += ((weights[-1] == 0) * mask).sum()  # rho > 0: zero weight is a masked token
        if a.mis_band is not None:
            weights.append(mis_mask(old_lp, roll, mask, a.mis_band))
            if sums is not None:
                sums["mis_rejected"] += ((1 - weights[-1]) * mask).any(-1).sum()
        return math.prod(weights[1:], start=weights[0]) if weights else None

    clip = ClipConfig(a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c, a.loss_agg_mode)
    minis = mini_batches(cfg, lay.dp, len(batch))
    plan = micro_plan(cfg, seqs.attention_mask.sum(1), minis, a.micro_batch_size)
    acc = dict.fromkeys(_SUMS, 0.0) | {"mismatch_max": 0.0}
    steps, grad_norm, lr = 0, 0.0, 0.0
    route_replay.take_sums()  # the router metrics are the first epoch's (as the mismatch's)
    routing: dict[str, float] = {}
    for epoch in range(a.ppo_epochs):
        for sl, micros in zip(minis, plan):
            norm = mini_batch_norm(seqs.mask[sl], lay.group)

            def loss_fn(lp, ent, k, micros=micros, norm=norm, first_epoch=epoch == 0):
                s = micros[k]
                mask = seqs.mask[s].to(lp.device)
                m = mask.to(lp.dtype)
                old_lp = old[s].to(lp.device) if old is not None else lp.detach()
                roll = rollout[s].to(lp.device)
                weight = correction(old_lp, roll, mask, acc if first_epoch else None)
                out = objective(lp, old_lp, adv[s].to(lp.device), mask, clip, norm, weight)
                loss = out.loss
                if ref is not None:
                    kl = kl_estimate(lp, ref[s].to(lp.device), cfg.algorithm.kl_estimator)
                    acc["kl"] += (kl.detach() * m).sum()
                    if cfg.algorithm.use_kl_loss:
                        loss = loss + cfg.algorithm.kl_coef * aggregate(kl, mask, a.loss_agg_mode, norm)
                acc["entropy"] += (ent.detach() * m).sum()
                if a.entropy_coef:
                    loss = loss - a.entropy_coef * aggregate(ent, mask, a.loss_agg_mode, norm)
                acc["loss"] += loss.detach()
                acc["clipped"] += out.clipped_tokens
                acc["tokens"] += m.sum()
                if first_epoch:
                    diff = (old_lp.detach() - roll) * m
                    acc["mismatch_sum"] += diff.abs().sum()
                    acc["mismatch_tokens"] += m.sum()
                    if m.numel():
                        acc["mismatch_max"] = torch.maximum(
                            torch.as_tensor(acc["mismatch_max"], device=diff.device), diff.abs().max()
                        )
                    acc["rollout_kl"] += (-diff).sum()
                    acc["seqs"] += float(mask.any(-1).sum())
                return loss * lay.dp  # FSDP averages gradients over dp_shard: undo it

            route_replay.set_objective(router_objective(run, seqs, sl))
            try:
                out = run.roles["actor"].train_step([seqs[s] for s in micros], loss_fn, with_entropy=True)
            finally:
                route_replay.set_objective(None)
            grad_norm += out["grad_norm"]
            lr = out["lr"]
            steps += 1
        if epoch == 0:
            routing = route_replay.take_sums()
    run.residency.weights_changed()
    acc = on_host(acc)
    final = {}
    if "response_version" in call.stage.inputs:  # partial rollout, separated: how old the trained tokens' policies are
        lag = call.it - (
            torch.cat(batch.columns["response_version"]) if len(batch) else torch.zeros(0, dtype=torch.int32)
        )
        acc |= {"lag_sum": float(lag.sum()), "lag_tokens": float(lag.numel())}
        final = {"policy_lag_max": global_max(float(lag.max()) if lag.numel() else 0.0)}
    acc |= {f"route_{k}": v for k, v in routing.items()}
    g = dp_sums({k: acc[k] for k in acc if k != "mismatch_max"}, lay.group)
    if final:
        final["policy_lag_mean"] = g["lag_sum"] / max(g["lag_tokens"], 1.0)
        k = cfg.stream.max_policy_lag
        if separated(cfg) and final["policy_lag_max"] > k:  # the schedule of trainer.async_loop rules this out
            raise RuntimeError(
                f"iteration {call.it} trained tokens {final['policy_lag_max']:.0f} updates old, above "
                f"stream.max_policy_lag={k}"
            )
    final |= route_replay.metrics({k.removeprefix("route_"): v for k, v in g.items() if k.startswith("route_")})
    if (
        a.moe_aux_loss_coef or a.moe_z_loss_coef
    ):  # each mini-batch's objective is the sum over its ranks and micro-batches
        final |= {"moe_aux_loss": g["route_aux"] / len(minis), "moe_z_loss": g["route_z"] / len(minis)}
    tokens, mt = max(g["tokens"], 1.0), max(g["mismatch_tokens"], 1.0)
    consumed = [(int(i), int(r)) for i, r in zip(batch.indices, batch.columns["prompt_row"])]
    return StageResult(
        consumed=consumed,
        final=final
        | {
            "loss": g["loss"] / max(steps, 1),
            "grad_norm": grad_norm / max(steps, 1),
            "lr": lr,
            "clip_frac": g["clipped"] / tokens,
            "kl": g["kl"] / tokens,
            "entropy": g["entropy"] / tokens,
            "logprob_mismatch_mean": g["mismatch_sum"] / mt,
            "logprob_mismatch_max": global_max(acc["mismatch_max"]),
            "rollout_kl": g["rollout_kl"] / mt,
            **({"icepop_masked_frac": g["icepop_masked"] / mt} if a.icepop_band else {}),
            **({"mis_rejected_frac": g["mis_rejected"] / max(g["seqs"], 1.0)} if a.mis_band else {}),
            "micro_batches": sum(map(len, plan)) / max(len(plan), 1),
        },
    )  # per optimizer step, the same on every rank
