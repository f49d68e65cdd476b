"""One module per stage of ``recipe.graph``; importing the package registers them all."""

from spmd_rl.trainer.stages import (  # noqa: F401
    actor_update,
    advantage,
    critic_update,
    forward,
    preference,
    reward,
    rollout,
)
from spmd_rl.trainer.stages.registry import REGISTRY, StageCall, StageResult, register, stage_fn  # noqa: F401
