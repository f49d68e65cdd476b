"""The FSDP backend's roles beyond the actor and its reference (``recipe.train_backends``'s
``TrainBackend.roles``): PPO's critic and the reward model, each a trunk with a one-output head
over the training mesh. Every builder takes ``(cfg, acc, mesh, total_steps)``."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from spmd_rl.config.schema import Config
from spmd_rl.distributed.accelerator import Accelerator
from spmd_rl.engines.fsdp.engine import TrainEngine


def critic(cfg: Config, acc: Accelerator, mesh: DeviceMesh, total_steps: int) -> TrainEngine:
    """PPO's critic: a value head on ``critic.model_path`` (the policy's trunk when unset),
    trained like the actor but at ``algorithm.critic_lr`` and without LoRA."""
    optim = cfg.actor.optim.model_copy(update={"lr": cfg.algorithm.critic_lr})
    settings = cfg.actor.model_copy(update={"optim": optim, "lora": None})
    path = cfg.critic.model_path or cfg.model.path
    return TrainEngine(path, acc, mesh, settings, cfg.model.dtype, total_steps=total_steps, head="value")


def reward_model(cfg: Config, acc: Accelerator, mesh: DeviceMesh, total_steps: int) -> TrainEngine:
    """The frozen reward model of ``reward.model_path``: a score head read at each sample's last token."""
    return TrainEngine(cfg.reward.model_path, acc, mesh, cfg.actor, cfg.model.dtype, trainable=False, head="score")
