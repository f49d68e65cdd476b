"""Periodic held-out evaluation inside a run (``trainer.eval_interval``): greedy accuracy of the
current policy on ``data.test_path`` through the rollout engine, while it holds the weights.

Generation DP group g takes test prompts g, g + D, g + 2D, ...; its TP rank 0 counts; the
counts are summed over the world, so the accuracy is over every evaluated prompt exactly once.
With ``rollout.environment`` each test prompt is a greedy multi-turn trajectory, scored on its
last sampled turn.
"""

from __future__ import annotations

from spmd_rl.data.prompts import PromptSet
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.metrics import global_sums


def eval_accuracy(run: Run, test: PromptSet, correct_fn) -> float:
    lay = run.lay.gen
    g, tp_rank = lay.coords(run.peer.rank)
    limit = run.cfg.trainer.eval_limit or len(test)
    mine = list(range(g, min(limit, len(test)), lay.dp))
    texts: list[str] = []
    if mine and run.turns is not None:
        items = [(test.prompt_ids[i], test.environment_row(i)) for i in mine]
        texts = [t.last_text for t in run.turns.run(items, temperature=0.0)]
    elif mine:
        samples = run.rollout.generate([test.prompt_ids[i] for i in mine], n=1,
                                       max_tokens=run.cfg.rollout.max_response_length, temperature=0.0)
        texts = run.tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
    hits = float(sum(correct_fn(t, test.answers[i]) > 0.5 for t, i in zip(texts, mine)))
    own = float(tp_rank == 0)
    g = global_sums({"hits": hits * own, "prompts": len(mine) * own})
    return g["hits"] / max(g["prompts"], 1.0)
