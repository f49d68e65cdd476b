"""A user's algorithms (``algorithm.name: tests.helpers.algorithms:MEDIAN``, a sequence
estimator; ``tests.helpers.algorithms:TOTAL``, a token estimator; ``...:SHORTER``, an advantage
stage of its own that reads the response lengths) and policy loss
(``actor.loss.policy_loss: tests.helpers.algorithms:plain_pg``), defined the way a user defines them
in their own module, with no edit to the package: a spec naming its estimator as
``module:function``, and a loss with the registered losses' signature."""

from __future__ import annotations

from spmd_rl.algos.specs import AlgorithmSpec


def median_baseline(rewards, group_size: int, norm_by_std: bool):
    """A_i = r_i - the median reward of its prompt's group (``torch.median``: the lower of the
    two middle values for an even N)."""
    r = rewards.reshape(-1, group_size)
    return (r - r.median(dim=1, keepdim=True).values).reshape(-1)


MEDIAN = AlgorithmSpec(
    "tests.helpers.algorithms:MEDIAN", "sequence", "tests.helpers.algorithms:median_baseline", group_relative=True
)


def total_reward(rewards, mask, gamma: float):
    """A_t = the sequence's total token reward, on every sampled token (no discount: ``gamma``
    is not read); the advantage stage then whitens it over the batch."""
    return rewards.sum(dim=1, keepdim=True) * mask


TOTAL = AlgorithmSpec("tests.helpers.algorithms:TOTAL", "token", "tests.helpers.algorithms:total_reward")


LENGTH_WEIGHT = 0.05


def shorter_is_better(call):
    """SHORTER's advantage stage: A_i = (r_i - mean of its group's r) - LENGTH_WEIGHT x L_i, L the
    response length in tokens (each token costs LENGTH_WEIGHT): the estimator interface sees only
    rewards, a stage sees any column written before it (``AlgorithmSpec.advantage_stage``)."""
    import torch

    from spmd_rl.trainer.stages.registry import StageResult

    cols, n = call.batch.columns, call.view.cfg.rollout.n
    if not len(call.batch):  # an empty share: nothing to write, no collective to enter
        return StageResult()
    r = torch.stack(cols["reward"]).double().reshape(-1, n)
    length = torch.stack(cols["response_length"]).double().reshape(-1, n)
    adv = (r - r.mean(1, keepdim=True)) - LENGTH_WEIGHT * length
    return StageResult(columns={"seq_advantage": adv.reshape(-1).float()})


SHORTER = AlgorithmSpec(
    "tests.helpers.algorithms:SHORTER",
    "sequence",
    group_relative=True,
    advantage_stage="tests.helpers.algorithms:shorter_is_better",
    advantage_inputs=("reward", "response_length"),
)


def plain_pg(logp, old_logp, advantages, mask, clip, norm=None, weight=None):
    """REINFORCE's -A log pi(y_t) per token (no ratio, no clip; the same gradient as the clipped
    surrogate on policy), aggregated as the registered objectives are (``algos.policy_loss``)."""
    from spmd_rl.algos.policy_loss import PolicyLossOut, aggregate

    adv = advantages if advantages.dim() == logp.dim() else advantages[:, None]
    per_token = -adv * logp * (1.0 if weight is None else weight)
    return PolicyLossOut(aggregate(per_token, mask, clip.agg_mode, norm), logp.new_zeros(()))
