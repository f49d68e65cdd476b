"""Which advantage estimators are per token, and which read a prompt's group, as names only: the
config's stage graph, its rules and the CLI read this without importing torch (``spmd-rl
validate`` and the launcher stay torch-free)."""

TOKEN_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline")
"""The estimators whose advantages are per token (the ``advantages`` column)."""

GROUP_ALGORITHMS = ("grpo", "dapo", "rloo", "reinforce_pp_baseline", "dpo")
"""The algorithms whose per-sample computation reads its prompt group (the group's rewards: GRPO's
mean and std, RLOO's leave-one-out mean, REINFORCE++-baseline's mean; DPO's pair of chosen and
rejected): every training DP rank must hold whole groups, the same number on every rank."""
