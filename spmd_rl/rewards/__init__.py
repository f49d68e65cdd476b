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
