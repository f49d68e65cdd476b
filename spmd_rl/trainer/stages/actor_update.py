"""actor_update: the policy objective (``trainer.stages.policy_objective``: the registered
``algos.policy_loss`` plus the KL and entropy terms, and the sums it records) over PPO epochs
and mini-batches; this module runs the loop and feeds the objective the right normaliser
(``minibatch``: one objective per mini-batch however it is split)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spmd_rl.algos import router_loss
from spmd_rl.algos.policy_loss import get_policy_loss
from spmd_rl.recipe.graph import advantage_column
from spmd_rl.engines.training import route_replay
from spmd_rl.trainer.metrics import global_max
from spmd_rl.trainer.stages.micro import micro_plan
from spmd_rl.trainer.stages.minibatch import dp_sums, length_order, mini_batch_norm, mini_batches
from spmd_rl.trainer.stages.policy_objective import PolicyObjective, UpdateSums
from spmd_rl.trainer.stages.registry import StageCall, StageResult, register
from spmd_rl.trainer.stages.samples import padded, seq_batch


def router_objective(view, seqs, sl: slice) -> route_replay.RouterObjective | None:
    """The mini-batch's router terms (``algos.router_loss``): its real tokens and, with load
    balancing, its load fractions from the rollout's routes, both summed over every DP rank
    (collective over the training side; None when both coefficients are 0)."""
    a = view.cfg.actor
    if not (a.moe.aux_loss_coef or a.moe.z_loss_coef):
        return None
    group, arch = view.lay.train.group, view.arch
    fractions = None
    if a.moe.aux_loss_coef:
        counts = router_loss.load_fractions(seqs[sl].routes or [], arch.num_experts)
        if not counts.numel():
            counts = torch.zeros(arch.num_layers, arch.num_experts, dtype=torch.float64)
        dist.all_reduce(counts, group=view.group)
        fractions = (counts / counts.sum(1, keepdim=True).clamp(min=1.0)).float()
    tokens = dp_sums({"tokens": float(seqs.attention_mask[sl].sum())}, group, view.group)["tokens"]
    return route_replay.RouterObjective(
        a.moe.aux_loss_coef, a.moe.z_loss_coef, fractions, max(tokens, 1.0), len(arch.sparse_layers), view.lay.train.dp
    )


def objective_inputs(call: StageCall):
    """(the sequences, their ``PolicyObjective``) in the loop's order (``length_order``), from the
    columns the stage graph declares (reference / old log-probs when present)."""
    view, batch = call.view, call.batch
    cfg, lay = view.cfg, view.lay.train
    seqs = seq_batch(view, batch)
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
    ref = padded(batch.columns["ref_log_prob"], width) if "ref_log_prob" in call.stage.inputs else None
    old = padded(batch.columns["old_log_prob"], width) if "old_log_prob" in call.stage.inputs else None
    order = length_order(cfg, lay.dp, seqs.attention_mask.sum(1))  # metrics are sums: no need to undo it
    seqs = seqs[order]
    ref, old = (None if t is None else t[order] for t in (ref, old))
    objective = get_policy_loss(cfg.actor.loss.policy_loss)
    return seqs, PolicyObjective(
        cfg.actor, cfg.algorithm, objective, seqs.mask, adv[order], rollout[order], ref, old, lay.dp
    )


@dataclass
class Steps:
    """What the optimizer steps returned, summed over the update."""

    count: int = 0
    grad_norm: float = 0.0
    lr: float = 0.0
    routing: dict[str, float] = field(default_factory=dict)
    """The router metrics' sums of the first epoch (``engines.training.route_replay``)."""


@register("actor_update")
def actor_update(call: StageCall) -> StageResult:
    """PPO epochs over mini-batches of this rank's share; one optimizer step per mini-batch."""
    view, cfg, lay = call.view, call.view.cfg, call.view.lay.train
    seqs, objective = objective_inputs(call)
    minis = mini_batches(cfg, lay.dp, len(call.batch))
    plan = micro_plan(cfg, seqs.attention_mask.sum(1), minis, cfg.actor.micro_batch_size, view.group)
    sums, steps = UpdateSums(), Steps()
    route_replay.take_sums()  # the router metrics are the first epoch's (as the mismatch's)
    for epoch in range(cfg.actor.ppo_epochs):
        for sl, micros in zip(minis, plan):
            norm = mini_batch_norm(seqs.mask[sl], lay.group, view.group, view.replicas.sum if view.replicas else None)

            def loss_fn(lp, ent, k, micros=micros, norm=norm, first_epoch=epoch == 0):
                return objective.loss(lp, ent, micros[k], norm, sums, first_epoch)

            router = router_objective(view, seqs, sl)
            out = view.roles["actor"].train_step([seqs[s] for s in micros], loss_fn, with_entropy=True, router=router)
            steps.grad_norm += out["grad_norm"]
            steps.lr = out["lr"]
            steps.count += 1
        if epoch == 0:
            steps.routing = route_replay.take_sums()
    view.weights_changed()
    consumed = [(int(i), int(r)) for i, r in zip(call.batch.indices, call.batch.columns["prompt_row"])]
    return StageResult(consumed=consumed, final=update_metrics(call, sums.to_host(), steps, len(minis), plan))


def update_metrics(call: StageCall, acc: dict[str, float], steps: Steps, minis: int, plan: list) -> dict[str, float]:
    """Collective: the update's metrics, per optimizer step, the same on every rank."""
    cfg, lay, batch, side = call.view.cfg, call.view.lay.train, call.batch, call.view.group
    a = cfg.actor
    final = {}
    if "response_version" in call.stage.inputs:  # partial rollout, separated: how old the trained tokens' policies are
        lag = call.it - (
            torch.cat(batch.columns["response_version"]) if len(batch) else torch.zeros(0, dtype=torch.int32)
        )
        acc |= {"lag_sum": float(lag.sum()), "lag_tokens": float(lag.numel())}
        final = {"policy_lag_max": global_max(float(lag.max()) if lag.numel() else 0.0, side)}
    acc |= {f"route_{k}": v for k, v in steps.routing.items()}
    g = dp_sums({k: acc[k] for k in acc if k != "mismatch_max"}, lay.group, side)
    if final:
        final["policy_lag_mean"] = g["lag_sum"] / max(g["lag_tokens"], 1.0)
        k = cfg.stream.max_policy_lag
        if (
            call.view.modes.separated and final["policy_lag_max"] > k
        ):  # the schedule of trainer.async_loop rules this out
            raise RuntimeError(
                f"iteration {call.it} trained tokens {final['policy_lag_max']:.0f} updates old, above "
                f"stream.max_policy_lag={k}"
            )
    final |= route_replay.metrics({k.removeprefix("route_"): v for k, v in g.items() if k.startswith("route_")})
    if a.moe.aux_loss_coef or a.moe.z_loss_coef:  # each mini-batch's objective is the sum over its ranks and micros
        final |= {"moe_aux_loss": g["route_aux"] / minis, "moe_z_loss": g["route_z"] / minis}
    tokens, mt = max(g["tokens"], 1.0), max(g["mismatch_tokens"], 1.0)
    return final | {
        "loss": g["loss"] / max(steps.count, 1),
        "grad_norm": steps.grad_norm / max(steps.count, 1),
        "lr": steps.lr,
        "clip_frac": g["clipped"] / tokens,
        "kl": g["kl"] / tokens,
        "entropy": g["entropy"] / tokens,
        "logprob_mismatch_mean": g["mismatch_sum"] / mt,
        "logprob_mismatch_max": global_max(acc["mismatch_max"], side),
        "rollout_kl": g["rollout_kl"] / mt,
        **({"icepop_masked_frac": g["icepop_masked"] / mt} if a.correction.icepop_band else {}),
        **({"mis_rejected_frac": g["mis_rejected"] / max(g["seqs"], 1.0)} if a.correction.mis_band else {}),
        "micro_batches": sum(map(len, plan)) / max(len(plan), 1),
    }
