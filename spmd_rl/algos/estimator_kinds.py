"""Which advantage estimators are per token, as names only: the config's stage graph and the CLI
read this without importing torch (``spmd-rl validate`` and the launcher stay torch-free)."""

TOKEN_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline")
"""The estimators whose advantages are per token (the ``advantages`` column)."""
