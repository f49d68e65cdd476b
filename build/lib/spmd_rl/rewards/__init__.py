"""Reward functions, registered by name; a user's own function loads as ``module:function``."""

from spmd_rl.rewards.registry import get_reward

__all__ = ["get_reward"]
