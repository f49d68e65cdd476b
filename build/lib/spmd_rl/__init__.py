"""spmd-rl: SPMD RL post-training with a distributed transfer dock and allgather-swap."""

__version__ = "0.1.0"
