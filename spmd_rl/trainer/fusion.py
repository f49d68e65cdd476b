"""Stage fusion, colocated (``stream.fuse``; MindSpeed RL Table 2, AsyncFlow's streamed
stages): while the rollout engine generates, the CPU-side stages run in the same process on
the prompt groups that already finished.

- The rollout streams: each prompt group is put into the dock as soon as the engine finishes
  it, so etcd records the arrival order (``dock.stream``).
- Each fused stage (``recipe.graph.fused_stages``) reads through a streaming get and is polled
  between the groups the engine returns; every wave complete by then runs there and then.
- After this rank's last group, the fused stages drain their remaining waves (each timed as its
  own stage: what is left is the part generation did not hide). The metrics
  ``fused_waves_early`` / ``fused_waves_late`` count the waves run during / after generation
  (the most of any rank).

Invariant (tested): the same function runs on the same samples (or whole groups) as in the
unfused graph, so the dock ends with the same columns and the metric sums are the same; only
the time moves.
"""

from __future__ import annotations

from spmd_rl.recipe.graph import Stage
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.metrics import StageTimer
from spmd_rl.trainer.runner import compute, group_size, is_writer, publish, stage_layout
from spmd_rl.trainer.stages import StageCall, StageResult
from spmd_rl.trainer.stages.registry import StageView
from spmd_rl.trainer.stages.rollout import rollout_columns, rollout_groups, turn_sums


def merge(results: list[StageResult]) -> StageResult:
    """One stage's results over its waves: sums added, maxima maxed, rewards added."""
    out = StageResult()
    for r in results:
        for k, v in r.sums.items():
            out.sums[k] = out.sums.get(k, 0.0) + v
        for k, v in r.maxes.items():
            out.maxes[k] = max(out.maxes.get(k, v), v)
        out.final |= r.final
        if r.rewards is not None:
            out.rewards = r.rewards.clone() if out.rewards is None else out.rewards + r.rewards
    return out


def _waves_per_group(run: Run, stage: Stage) -> int:
    """Units per DP group in a wave: samples, or whole prompt groups."""
    micro, n = run.cfg.stream.micro_batch_size, run.cfg.rollout.n
    return -(-micro // n) if stage.group_granular else micro


def run_fused(
    run: Run, it: int, rollout: Stage, fused: list[Stage], expected: list[int], timer: StageTimer
) -> list[StageResult]:
    """The rollout stage with ``fused`` running on its finished groups; one merged result per
    stage, rollout first."""
    results: dict[str, list[StageResult]] = {s.name: [] for s in (rollout, *fused)}
    with timer.stage(rollout.name):
        run.residency.enter(rollout.name, rollout.roles)
        batch = run.dock.get(
            rollout.name,
            it,
            list(rollout.inputs),
            stage_layout(run, rollout),
            group_size=group_size(run, rollout),
            expected=expected,
        )
        streams = [
            run.dock.stream(
                s.name, it, s.inputs, stage_layout(run, s), expected, group_size(run, s), _waves_per_group(run, s)
            )
            for s in fused
        ]
        writer = is_writer(run, rollout)
        for indices, samples in rollout_groups(
            StageCall(StageView.of(run, rollout), it, rollout, batch, writer, expected)
        ):
            results[rollout.name].append(
                publish(
                    run,
                    it,
                    rollout,
                    indices,
                    StageResult(columns=rollout_columns(samples), sums=turn_sums(run.modes, samples)),
                    writer,
                )
            )
            for stage, stream in zip(fused, streams):
                while (wave := stream.poll()) is not None:
                    results[stage.name].append(_run_wave(run, it, stage, wave, expected))
    early = sum(len(results[s.name]) for s in fused)
    for stage, stream in zip(fused, streams):
        with timer.stage(stage.name):
            run.residency.record(stage.name)
            results[stage.name] += [_run_wave(run, it, stage, wave, expected) for wave in stream]
    merged = [merge(results[s.name]) for s in (rollout, *fused)]
    merged[0].maxes |= {
        "fused_waves_early": float(early),
        "fused_waves_late": float(sum(map(len, results.values())) - early - len(results[rollout.name])),
    }
    merged[0].sums = turn_sums(run.modes, []) | merged[0].sums  # every key on every rank, groups or not
    return merged


def _run_wave(run: Run, it: int, stage: Stage, wave, expected: list[int]) -> StageResult:
    if not len(wave):
        return StageResult()
    return compute(run, it, stage, wave, expected)
