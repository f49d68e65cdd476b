"""advantage: a critic-free estimator's advantages, or PPO's GAE with whitened advantages; which
one is the algorithm's spec (``algos.specs``: ``advantage``, ``estimator``, ``centre_scores``).

- GRPO/DAPO/RLOO (group-granular): the sequence score s = r - beta sum_t kl_t when KL is in the
  reward (else s = r), then A = the registered sequence estimator of s
  (``algos.estimators.SEQ_ESTIMATORS``), one scalar per sample.
- REINFORCE++ (-baseline), or a user's token estimator: the spec's token estimator of the
  token rewards (discounted returns, ``algos.estimators.TOKEN_ESTIMATORS``), whitened with the
  moments of every sampled token of the iteration's batch (summed over the DP ranks, and over
  the elastic replicas, as PPO's whitening: ``batch_moments``).
- PPO: token rewards (``algos.core.token_rewards``), GAE with ``algorithm.gamma`` / ``lam``
  in float64 over the sampled tokens (a multi-turn response's inserted tokens are skipped), returns = A + V (before
  whitening), then A whitened with the mean and variance
  of the *whole iteration's* tokens: moments are summed over the DP ranks (each DP group
  once), so the result does not depend on the layout (tested against a single-process float64
  recomputation from the dock's columns).

KL-in-reward uses kl_t = estimator(old_log_prob_t, ref_log_prob_t) (``algorithm.kl_estimator``).
"""

from __future__ import annotations

import torch

from spmd_rl.algos.specs import AlgorithmSpec
from spmd_rl.algos.core import gae, kl_estimate, masked_moments, token_rewards, whiten
from spmd_rl.algos.estimators import SEQ_ESTIMATORS, TOKEN_ESTIMATORS, group_centred
from spmd_rl.recipe.graph import algorithm
from spmd_rl.trainer.stages.minibatch import dp_sums
from spmd_rl.trainer.stages.registry import StageCall, StageResult, register
from spmd_rl.trainer.stages.samples import padded


def _kl(call: StageCall, width: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Per-token KL [B, width] when KL is in the reward (else None), and the mask of the
    sampled response tokens (a multi-turn response's inserted tokens are out)."""
    cols = call.batch.columns
    lengths = torch.stack(cols["response_length"]).long()
    mask = torch.arange(width)[None, :] < lengths[:, None]
    if "response_mask" in cols:
        mask &= padded(cols["response_mask"], width, torch.bool)
    if "ref_log_prob" not in cols:
        return None, mask
    old, ref = padded(cols["old_log_prob"], width, torch.float64), padded(cols["ref_log_prob"], width, torch.float64)
    return kl_estimate(old, ref, call.view.cfg.algorithm.kl_estimator) * mask, mask


@register("advantage")
def advantage(call: StageCall) -> StageResult:
    view, batch = call.view, call.batch
    spec = algorithm(view.cfg)
    if not len(batch):  # every rank enters every collective, even with an empty share: the whitening's sums
        if spec.advantage in ("gae", "token"):
            batch_moments(view, (0.0, 0.0, 0.0))
        return StageResult(sums={"adv_zero_groups": 0.0})
    rewards = torch.stack(batch.columns["reward"]).to(torch.float64)
    if spec.advantage == "gae":
        return _gae(call, rewards)
    if spec.advantage == "token":
        return _reinforce(call, rewards, spec)
    n, sums = view.cfg.rollout.n, {}
    if "ref_log_prob" in batch.columns:
        width = int(torch.stack(batch.columns["response_length"]).max())
        kl, mask = _kl(call, width)
        rewards = rewards - view.cfg.algorithm.kl_coef * kl.sum(-1)
        sums = {"kl_reward_sum": float(kl.sum()), "kl_reward_tokens": float(mask.sum())}
    adv = SEQ_ESTIMATORS.lookup(spec.estimator)(rewards, n, view.cfg.algorithm.norm_adv_by_std)
    sums["adv_zero_groups"] = float((adv.reshape(-1, n) == 0).all(dim=1).sum())
    return StageResult(columns={"seq_advantage": adv.float()}, sums=sums)


def batch_moments(view, moments) -> tuple[float, float, float]:
    """Collective: the whole batch's (count, sum, sum of squares) from this rank's: summed over
    the DP ranks (a DP group's ranks hold the same samples: counted once) and, with elastic
    replicas, over the replicas (each holds its share of the global batch), so the whitening
    is the one job's whatever the split."""
    g = dp_sums(dict(zip(("n", "s", "q"), (float(m) for m in moments))), view.lay.train.group, view.group)
    if view.replicas is None:
        return g["n"], g["s"], g["q"]
    n, s, q = view.replicas.sum(torch.tensor([g["n"], g["s"], g["q"]], dtype=torch.float64)).tolist()
    return n, s, q


def _gae(call: StageCall, scores: torch.Tensor) -> StageResult:
    view, cols, algo = call.view, call.batch.columns, call.view.cfg.algorithm
    lengths = torch.stack(cols["response_length"]).long()
    width = max(1, int(lengths.max()))
    values = padded(cols["values"], width, torch.float64)
    kl, mask = _kl(call, width)
    rewards = token_rewards(scores, lengths, width, kl, algo.kl_coef, mask)
    adv, returns = gae(rewards, values * mask, mask, algo.gamma, algo.lam)
    white = whiten(adv, mask, *batch_moments(view, masked_moments(adv, mask)))
    lens = lengths.tolist()
    resid = (returns - values) * mask
    sums = {
        "returns_sum": float((returns * mask).sum()),
        "returns_sq": float((returns.square() * mask).sum()),
        "resid_sum": float(resid.sum()),
        "resid_sq": float(resid.square().sum()),
        "values_sum": float((values * mask).sum()),
        "value_tokens": float(mask.sum()),
    }
    if kl is not None:
        sums |= {"kl_reward_sum": float(kl.sum()), "kl_reward_tokens": float(mask.sum())}
    return StageResult(
        columns={
            "advantages": [white[k, :L].float() for k, L in enumerate(lens)],
            "returns": [returns[k, :L].float() for k, L in enumerate(lens)],
        },
        sums=sums,
    )


def _reinforce(call: StageCall, scores: torch.Tensor, spec: AlgorithmSpec) -> StageResult:
    view, cols, algo = call.view, call.batch.columns, call.view.cfg.algorithm
    lengths = torch.stack(cols["response_length"]).long()
    width = max(1, int(lengths.max()))
    if spec.centre_scores:
        scores = group_centred(scores, view.cfg.rollout.n)
    kl, mask = _kl(call, width)
    estimate = TOKEN_ESTIMATORS.lookup(spec.estimator)
    returns = estimate(token_rewards(scores, lengths, width, kl, algo.kl_coef, mask), mask, algo.gamma) * mask
    white = whiten(returns, mask, *batch_moments(view, masked_moments(returns, mask)))
    sums = {"kl_reward_sum": float(kl.sum()), "kl_reward_tokens": float(mask.sum())} if kl is not None else {}
    return StageResult(
        columns={"advantages": [white[k, :L].float() for k, L in enumerate(lengths.tolist())]},
        sums=sums | {"adv_zero_groups": 0.0},
    )
