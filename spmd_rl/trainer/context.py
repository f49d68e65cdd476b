"""Everything a stage needs, built once per process: layouts, dock, engines, data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from spmd_rl.config.layout import Layouts
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.config.schema import Config
from spmd_rl.data.prompts import PromptSet
from spmd_rl.data.sampler import PromptSampler
from spmd_rl.distributed.accelerator import Accelerator
from spmd_rl.distributed.sides import Sides
from spmd_rl.dock.client import TransferDock
from spmd_rl.dock.fetch import Peer
from spmd_rl.elastic.replicas import Replicas
from spmd_rl.engines.base import Rollout
from spmd_rl.recipe.graph import Modes, Stage, fused_stages
from spmd_rl.engines.base import Engine
from spmd_rl.envs.factory import environment_factory
from spmd_rl.envs.multi_turn import MultiTurnRollout, TurnLimits
from spmd_rl.gateway.rollout import AgentRollout, agent_rollout
from spmd_rl.reshard.residency import Residency
from spmd_rl.trainer.ledger import PromptLedger


@dataclass
class Progress:
    """What a run changes as it goes; everything else in ``Run`` is fixed once built."""

    policy_version: int = 0
    """Separated placement, on a generator: the updates behind the weights its engine holds."""
    carry: list = field(default_factory=list)
    """Partial rollout: the ``trainer.carry.CarriedGroup`` s this generation DP group continues next."""


@dataclass(frozen=True)
class HeldOut:
    """The held-out sets of ``eval.interval`` (``data.test_path``, by name), the reward rule
    that decides an answer is right (``trainer.evaluate``): ``correct(response, answer, row)``,
    a score or a dict with one (``rewards.registry``), and ``extract(response)``: the answer
    that maj@n votes on (``reward.extract``; None where it finds none)."""

    sets: dict[str, PromptSet]
    correct: Callable[[str, str, dict], Any]
    extract: Callable[[str], str | None]


@dataclass(frozen=True, kw_only=True)
class Run:
    """Built once per process with keywords (``trainer.trainer.Trainer``) and never reassigned; what changes
    over the run lives in ``progress``."""

    cfg: Config
    lay: Layouts
    peer: Peer
    acc: Accelerator
    dock: TransferDock
    sides: Sides
    """This rank's side of the placement: its group, whose rank writes its files (``distributed.sides``)."""
    modes: Modes
    """What the run is (``recipe.graph.Modes.of``), derived once from the config."""
    graph: list[Stage]
    """The stage graph of this config (``recipe.graph.stages_for``), built once; the one that runs."""
    roles: dict[str, Engine]
    """One engine per training-side role: actor, and ref / critic / reward_model when the graph has them."""
    rollout: Rollout | None
    """None on a training rank of the separated placement."""
    residency: Residency
    tokenizer: Any
    prompts: PromptSet
    sampler: PromptSampler
    reward_fn: Any
    lineage: str = ""
    """The id of the checkpoint lineage this run writes (``trainer.checkpoint.lineage_id``);
    the leader's names the W&B run."""
    held_out: HeldOut | None = None
    """What the periodic evaluation scores (``eval.interval``), else None."""
    ledger: PromptLedger | None = None
    """Exactly-once prompt accounting in etcd (``trainer.ledger``); rank 0 writes it."""
    gen_tp_group: Any = None
    """Multi-turn with generation TP > 1: this rank's generation group (``envs.turn_sync``)."""
    replicas: Replicas | None = None
    """Elastic replicas (``elastic.replicas``): this replica's side of the job's replicas."""
    progress: Progress = field(default_factory=Progress)

    @cached_property
    def fused(self) -> list[Stage]:
        """The stages that run inside the rollout (``stream.fuse``; ``recipe.graph.fused_stages``),
        derived once from the graph."""
        return fused_stages(self.cfg, self.graph)

    @cached_property
    def arch(self) -> ModelArch:
        """The policy's architecture (``model.path``'s config.json)."""
        return ModelArch.from_folder(self.cfg.model.path)

    @cached_property
    def turns(self) -> MultiTurnRollout | AgentRollout | None:
        """Multi-turn rollouts through this rank's engine: an environment's (``rollout.environment``)
        or an agent's through this rank's gateway (``rollout.agent``); else None."""
        r = self.cfg.rollout
        if not self.modes.multi_turn or self.rollout is None:
            return None
        if self.modes.agent:
            return agent_rollout(self.cfg, self.rollout, self.tokenizer, Path(self.cfg.model.path).name)
        return MultiTurnRollout(
            self.rollout,
            self.tokenizer,
            environment_factory(r.environment, r.unsafe_python_without_jail),
            TurnLimits(r.max_turns, r.max_response_length, r.tool_timeout_s),
            tp_group=self.gen_tp_group,
        )

    @property
    def actor(self) -> Engine:
        return self.roles["actor"]
