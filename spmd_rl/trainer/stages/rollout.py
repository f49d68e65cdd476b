"""actor_rollout: N responses per prompt group from the rollout engine (generation layout,
group-granular: a generation DP group receives whole prompt groups). Seeded per iteration and
by the first sample index, so a rerun of the iteration samples the same responses."""

from __future__ import annotations

import torch

from spmd_rl.trainer.stages.registry import StageCall, StageResult, register


@register("actor_rollout")
def actor_rollout(call: StageCall) -> StageResult:
    run, batch = call.run, call.batch
    n = run.cfg.rollout.n
    idx = batch.indices.tolist()
    if not idx:
        return StageResult()
    seed = run.cfg.trainer.seed * 1_000_003 + call.it * 10_007 + idx[0]
    firsts = batch.columns["prompt_ids"][::n]
    samples = run.rollout.generate([p.tolist() for p in firsts], n=n, max_tokens=run.cfg.rollout.max_response_length, seed=seed)
    return StageResult(columns={
        "response_ids": [torch.tensor(s.token_ids, dtype=torch.int32) for s in samples],
        "rollout_log_prob": [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples],
        "response_length": torch.tensor([len(s.token_ids) for s in samples], dtype=torch.int32),
    })
