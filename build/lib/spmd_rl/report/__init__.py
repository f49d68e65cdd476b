"""``spmd-rl report``: pictures of a finished (or running) run from its logging folder."""
