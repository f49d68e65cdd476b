"""actor_rollout: N responses per prompt group from the rollout engine (generation layout,
group-granular: a generation DP group receives whole prompt groups). Seeded per iteration and
by the first sample index, so a rerun of the iteration samples the same responses.

``rollout_groups`` yields each prompt group as the engine finishes it (stage fusion streams
them into the dock); the stage function collects them all, so both paths write the same
samples."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from spmd_rl.engines.rollout import Sample
from spmd_rl.trainer.stages.registry import StageCall, StageResult, register


def rollout_groups(call: StageCall) -> Iterator[tuple[list[int], list[Sample]]]:
    """(sample indices, samples) of each of this share's prompt groups, in finishing order."""
    run, batch = call.run, call.batch
    n = run.cfg.rollout.n
    idx = batch.indices.tolist()
    if not idx:
        return
    seed = run.cfg.trainer.seed * 1_000_003 + call.it * 10_007 + idx[0]
    firsts = batch.columns["prompt_ids"][::n]
    for p, samples in run.rollout.generate_stream([f.tolist() for f in firsts], n=n, max_tokens=run.cfg.rollout.max_response_length, seed=seed):
        yield idx[p * n:(p + 1) * n], samples


def rollout_columns(samples: list[Sample]) -> dict[str, object]:
    return {
        "response_ids": [torch.tensor(s.token_ids, dtype=torch.int32) for s in samples],
        "rollout_log_prob": [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples],
        "response_length": torch.tensor([len(s.token_ids) for s in samples], dtype=torch.int32),
    }


@register("actor_rollout")
def actor_rollout(call: StageCall) -> StageResult:
    if not len(call.batch):
        return StageResult()
    groups = sorted(rollout_groups(call), key=lambda g: g[0])
    return StageResult(columns=rollout_columns([s for _, samples in groups for s in samples]))
