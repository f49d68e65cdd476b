"""The one stage runner: resident roles -> get -> compute -> put.

For a stage of the graph (``recipe.graph.Stage``):

1. the residency manager makes exactly the stage's roles resident;
2. the dock delivers the stage's declared inputs in the stage's layout, whole prompt groups
   when the stage is group-granular, for the samples ``expected``, each mini-batch shared out
   on its own when the stage is mini-batched;
3. the registered function computes (``trainer.stages``);
4. the writer rule: only TP rank 0 of each DP group puts the outputs and counts its metric
   sums (its TP peers computed the same). A stage that returns columns must return all of
   its declared outputs and nothing else.
"""

from __future__ import annotations

from spmd_rl.recipe.graph import Stage
from spmd_rl.distributed import timeline
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.metrics import StageTimer
from spmd_rl.trainer.stages import StageCall, StageResult, stage_fn
from spmd_rl.trainer.stages.registry import StageView
from spmd_rl.trainer.stages.minibatch import mini_batch_count


def run_stage(run: Run, it: int, stage: Stage, expected: list[int], timer: StageTimer) -> StageResult:
    with timer.stage(stage.name):
        with timeline.span("residency"):
            run.residency.enter(stage.name, stage.roles)
        layout = stage_layout(run, stage)
        with timeline.span("dock_get"):
            batch = run.dock.get(
                stage.name,
                it,
                list(stage.inputs),
                layout,
                group_size=group_size(run, stage),
                expected=expected,
                parts=mini_batch_count(run.cfg) if stage.mini_batched else 1,
            )
        return compute(run, it, stage, batch, expected)


def stage_layout(run: Run, stage: Stage):
    return run.lay.gen if stage.layout == "gen" else run.lay.train


def group_size(run: Run, stage: Stage) -> int:
    return run.cfg.rollout.n if stage.group_granular else 1


def is_writer(run: Run, stage: Stage) -> bool:
    return stage_layout(run, stage).coords(run.peer.rank)[1] == 0


def compute(run: Run, it: int, stage: Stage, batch, expected: list[int]) -> StageResult:
    """Steps 3 and 4 for one batch of the stage (the whole share, or one streamed wave)."""
    writer = is_writer(run, stage)
    return publish(
        run,
        it,
        stage,
        batch.indices,
        stage_fn(stage.fn or stage.name)(StageCall(StageView.of(run, stage), it, stage, batch, writer, expected)),
        writer,
    )


def publish(run: Run, it: int, stage: Stage, indices, result: StageResult, writer: bool) -> StageResult:
    """The writer rule: check and put the result's columns for ``indices``; zero the metric
    sums of non-writers."""
    if result.columns is not None:
        if set(result.columns) != set(stage.outputs):
            raise RuntimeError(
                f"stage {stage.name} returned columns {sorted(result.columns)}, its graph entry declares "
                f"{sorted(stage.outputs)}"
            )
        if writer and len(indices):
            with timeline.span("dock_put"):
                run.dock.put(stage.name, it, result.columns, indices)
    if not writer:
        result.sums = dict.fromkeys(result.sums, 0.0)
        if result.consumed is not None:
            result.consumed = []
        if result.rewards is not None:
            result.rewards.zero_()
    return result
