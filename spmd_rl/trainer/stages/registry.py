"""The stage registry: one compute function per stage name of ``recipe.graph``.

A stage function receives its batch (exactly the stage's declared input columns, in the
stage's layout, whole prompt groups when the stage is group-granular) and returns a
``StageResult``. It never talks to the dock or moves memory itself: the runner gets, puts and
applies the writer rule, the residency manager makes the stage's roles resident.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from spmd_rl.catalog import Registry
from spmd_rl.config.layout import Layouts
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.config.schema import Config
from spmd_rl.data.prompts import PromptSet
from spmd_rl.elastic.replicas import Replicas
from spmd_rl.engines.base import Engine, Rollout
from spmd_rl.envs.multi_turn import MultiTurnRollout
from spmd_rl.recipe.graph import Modes, Stage
from spmd_rl.trainer.context import Run


@dataclass(frozen=True, kw_only=True)
class StageView:
    """What a stage may read of the run: the config and its modes, the layouts, its side's
    process group, the engines of the roles its graph entry declares (no other), the data it
    decodes or scores with, and the one effect it may have on memory, ``weights_changed``. Not
    the dock, the sampler, the ledger, the residency manager or the placement: the runner gets,
    puts and moves memory. The runner builds one per stage call (``of``); a test builds one
    with what its stage reads."""

    cfg: Config
    modes: Modes | None = None
    lay: Layouts | None = None
    group: Any = None
    """The side's process group every metric reduction passes (``Run.sides.group``; None: the world)."""
    roles: dict[str, Engine] = field(default_factory=dict)
    """The declared roles' engines (``Stage.roles``)."""
    rollout: Rollout | None = None
    """The rollout engine, when the stage declares the ``rollout`` role."""
    tokenizer: Any = None
    prompts: PromptSet | None = None
    reward_fn: Callable[[str, str, dict], Any] | None = None
    turns: MultiTurnRollout | None = None
    replicas: Replicas | None = None
    """Elastic replicas: the stage sums its normalisers over them (``Replicas.sum``)."""
    policy_version: int = 0
    """Separated placement, on a generator: the updates behind its engine's weights."""
    weights_changed: Callable[[], None] = lambda: None
    """Tell the residency manager the actor's weights changed (an update stage, after its steps)."""

    @cached_property
    def arch(self) -> ModelArch:
        """The policy's architecture (``model.path``'s config.json), read on first use."""
        return ModelArch.from_folder(self.cfg.model.path)

    @classmethod
    def of(cls, run: Run, stage: Stage) -> "StageView":
        """``run`` as ``stage`` may see it. With ``actor.lora`` the reference is the actor with its
        adapters off (``engines.training.lora``): a stage declaring the actor sees it too."""
        declared = set(stage.roles) | ({"ref"} if run.cfg.actor.lora is not None and "actor" in stage.roles else set())
        return cls(
            cfg=run.cfg,
            modes=run.modes,
            lay=run.lay,
            group=run.sides.group,
            roles={r: e for r, e in run.roles.items() if r in declared},
            rollout=run.rollout if "rollout" in declared else None,
            tokenizer=run.tokenizer,
            prompts=run.prompts,
            reward_fn=run.reward_fn,
            turns=run.turns if "rollout" in declared else None,
            replicas=run.replicas,
            policy_version=run.progress.policy_version,
            weights_changed=run.residency.weights_changed,
        )


@dataclass
class StageCall:
    view: StageView
    """What the stage may read of the run."""
    it: int
    stage: Stage
    batch: Any
    """The dock's ``Batch``: ``indices`` and ``columns`` (one tensor per sample and column)."""
    writer: bool
    """TP rank 0 of this rank's DP group: the one whose outputs are written and whose metric
    sums count (its TP peers computed the same)."""
    expected: list[int]

    @property
    def run(self):
        """Gone in 0.2: a stage function written against 0.1 gets this message, not a bare AttributeError."""
        raise AttributeError(
            "StageCall.run was removed in 0.2: read call.view (trainer.stages.registry.StageView: cfg, lay, "
            "roles, tokenizer, prompts, ...)"
        )


@dataclass
class StageResult:
    columns: dict[str, Any] | None = None
    """The stage's output columns for ``batch.indices`` (all of the stage's declared outputs)."""
    sums: dict[str, float] = field(default_factory=dict)
    """Metric sums of this rank's share; the runner zeroes them on non-writers, the loop sums
    them over ranks."""
    maxes: dict[str, float] = field(default_factory=dict)
    """Metric maxima; the loop takes the maximum over ranks."""
    final: dict[str, float] = field(default_factory=dict)
    """Metrics every rank already agrees on (global reductions done by the stage)."""
    rewards: torch.Tensor | None = None
    """Reward stage: the round's rewards as a dense [len(expected)] tensor with this rank's
    written scores (0 elsewhere), summed over ranks by dynamic sampling."""
    consumed: list[tuple[int, int]] | None = None
    """actor_update: (sample index, dataset row) of every sample this rank's share read from the
    dock, the row as its ``prompt_row`` column holds it (the ledger's observed ``trained``); the
    runner empties it on non-writers."""
    pieces: dict[int, Any] | None = None
    """Partial rollout's rollout stage: every sample of this rank's share (index ->
    ``trainer.partial.Piece``), its response so far and whether it finished."""


StageFn = Callable[[StageCall], StageResult]
REGISTRY: Registry[StageFn] = Registry(
    "stage", hint="; add a module under trainer/stages/ with @register(<stage name>)"
)
register = REGISTRY.register
stage_fn = REGISTRY.lookup
