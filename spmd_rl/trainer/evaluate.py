"""Periodic held-out evaluation inside a run (``trainer.eval_interval``): greedy accuracy of the
current policy on ``data.test_path`` through the rollout engine, while it holds the weights.

Generation DP group g takes test prompts g, g + D, g + 2D, ...; its TP rank 0 marks the prompts
it answered right in a vector over the evaluated prompts, and one all-reduce over the side sums
them, so every evaluated prompt is counted exactly once. The side's leader appends which prompts
were right to ``<logging.dir>/eval_prompts.jsonl`` (``{"iteration": k, "prompts": n, "correct":
[...]}``, k = the number of updates behind the policy): evaluations of the same prompts can then
be compared prompt by prompt (a paired comparison), which a single accuracy cannot. With
``rollout.environment`` each test prompt is a greedy multi-turn trajectory, scored on its last
sampled turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_rl.rewards.pool import pool_of
from spmd_rl.trainer.context import Run

RECORD = "eval_prompts.jsonl"


def eval_accuracy(run: Run, iteration: int) -> float:
    """Collective over the side: the accuracy on ``run.held_out`` of the policy after
    ``iteration`` updates."""
    test, correct_fn = run.held_out.prompts, run.held_out.correct
    lay = run.lay.gen
    g, tp_rank = lay.coords(run.peer.rank)
    count = min(run.cfg.trainer.eval_limit or len(test), len(test))
    mine = list(range(g, count, lay.dp))
    texts: list[str] = []
    if mine and run.turns is not None:
        items = [(test.prompt_ids[i], test.environment_row(i)) for i in mine]
        texts = [t.last_text for t in run.turns.run(items, temperature=0.0)]
    elif mine:
        samples = run.rollout.generate(
            [test.prompt_ids[i] for i in mine], n=1, max_tokens=run.cfg.rollout.max_response_length, temperature=0.0
        )
        texts = run.tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
    hits = torch.zeros(count, dtype=torch.float64)
    if tp_rank == 0 and mine:  # a generation group's TP ranks produced the same texts
        scored = pool_of(run.cfg.reward, correct_fn).score(
            texts, [test.answers[i] for i in mine], [test.info(i) for i in mine]
        )
        for s, i in zip(scored.scores, mine):
            hits[i] = float(s > 0.5)
    dist.all_reduce(hits, group=run.sides.group)
    correct = hits.nonzero().flatten().tolist()
    if run.peer.rank == run.sides.leader:
        folder = Path(run.cfg.logging.dir)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / RECORD, "a") as f:
            f.write(json.dumps({"iteration": iteration, "prompts": count, "correct": correct}) + "\n")
    return len(correct) / max(count, 1)
