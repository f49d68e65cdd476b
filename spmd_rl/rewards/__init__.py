"""Reward functions, registered by name; a user's own function loads as ``module:function``; a
service is called over HTTP (``remote``)."""

from spmd_rl.rewards.registry import get_reward
from spmd_rl.rewards.remote import RemoteReward

__all__ = ["get_reward", "reward_for"]


def reward_for(reward):
    """The run's reward function as the ``reward`` section names it: its rule, or its service."""
    if reward.kind == "remote":
        return RemoteReward(reward.url, reward.timeout_s, reward.retries, reward.token_env)
    return get_reward(reward.rule, reward.format_score, reward.extract)


def correctness_for(reward):
    """What decides a held-out answer is right (score > 0.5): the run's rule without its format
    score (partial credit is not a right answer), or its service."""
    if reward.kind == "remote":
        return reward_for(reward)
    return get_reward(reward.rule, extract=reward.extract)
