"""The stage registry: one compute function per stage name of ``recipe.graph``.

A stage function receives its batch (exactly the stage's declared input columns, in the
stage's layout, whole prompt groups when the stage is group-granular) and returns a
``StageResult``. It never talks to the dock or moves memory itself: the runner gets, puts and
applies the writer rule, the residency manager makes the stage's roles resident.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd_rl.catalog import Registry
from spmd_rl.recipe.graph import Stage
from spmd_rl.trainer.context import Run


@dataclass
class StageCall:
    run: Run
    it: int
    stage: Stage
    batch: Any
    """The dock's ``Batch``: ``indices`` and ``columns`` (one tensor per sample and column)."""
    writer: bool
    """TP rank 0 of this rank's DP group: the one whose outputs are written and whose metric
    sums count (its TP peers computed the same)."""
    expected: list[int]


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
