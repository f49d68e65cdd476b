"""Held-out evaluation inside a run (``eval.interval``): every set of ``data.test_path``
answered by the current policy through the rollout engine, while it holds the weights, and
scored by ``trainer.eval_scores``: greedy accuracy (``eval.greedy``) and, with ``eval.n``,
mean@n, pass@k and maj@n of n sampled answers at ``eval.temperature`` / ``eval.top_p``, per set
and per ``data_source``.

Generation DP group g takes a set's prompts g, g + D, g + 2D, ...; its TP rank 0 writes what it
scored into a table over the set's prompts (greedy right, majority right, each sampled answer
right), and one all-reduce over the side sums the tables, so every evaluated prompt is counted
exactly once. Sampled answers are seeded by ``trainer.seed`` and the prompt's index in its set,
so the same policy gives the same answers whatever the generation layout. The side's leader
appends each set's per-prompt results to ``<logging.dir>/eval_prompts.jsonl`` (``{"iteration":
k, "set": name, "prompts": n, "correct": [...]}`` with the greedy answers' right prompts, and
``"sampled_right"``: each prompt's count of right sampled answers), k = the number of updates
behind the policy: evaluations of the same prompts can then be compared prompt by prompt (a
paired comparison), which a single accuracy cannot. With ``rollout.environment`` each answer is
a multi-turn trajectory, scored on its last sampled turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spmd_rl.config.runtime_schema import EvalConfig
from spmd_rl.config.schema import Config, RewardConfig
from spmd_rl.data.prompts import PromptSet, prompts_for, test_sets
from spmd_rl.engines.base import Rollout
from spmd_rl.rewards import correctness_for
from spmd_rl.rewards.extract import EXTRACTORS
from spmd_rl.rewards.pool import pool_of
from spmd_rl.trainer.context import HeldOut, Run
from spmd_rl.trainer.eval_scores import majority_right, set_scores

RECORD = "eval_prompts.jsonl"
GREEDY, MAJORITY, SAMPLED = 0, 1, 2
"""Columns of a set's table: greedy right, majority right, then one per sampled answer."""


@dataclass(frozen=True)
class Evaluation:
    """What answers and scores held-out prompts, the same in a run (``evaluate``) and offline
    (``trainer.offline_eval``): the ``eval`` and ``reward`` sections, the sets and rule, the
    engine and tokenizer, the multi-turn rollout (None: single turn), the seed of sampled answers."""

    cfg: EvalConfig
    reward: RewardConfig
    held_out: HeldOut
    rollout: Rollout
    tokenizer: Any
    turns: Any
    seed: int
    max_tokens: int

    @classmethod
    def of(cls, run: Run) -> "Evaluation":
        return cls.of_config(run.cfg, run.held_out, run.rollout, run.tokenizer, run.turns)

    @classmethod
    def of_config(cls, c: Config, held_out: HeldOut, rollout: Rollout, tokenizer, turns) -> "Evaluation":
        """The evaluation a config describes: its ``eval`` and ``reward`` sections, its seed, and
        ``eval.max_tokens`` (else ``rollout.max_response_length``)."""
        max_tokens = c.eval.max_tokens or c.rollout.max_response_length
        return cls(c.eval, c.reward, held_out, rollout, tokenizer, turns, c.trainer.seed, max_tokens)

    def table(self, test: PromptSet, mine: list[int], count: int, score: bool = True) -> torch.Tensor:
        """A set's table over its first ``count`` prompts (module docstring) with the rows
        ``mine`` answered, and filled where ``score``."""
        n = self.cfg.n
        table = torch.zeros(count, SAMPLED + n, dtype=torch.float64)
        greedy = self._answers(test, mine, 1, 0.0, None) if self.cfg.greedy and mine else []
        sampled = self._answers(test, mine, n, self.cfg.temperature, self.cfg.top_p) if n and mine else []
        if score and mine:
            self._score(test, mine, greedy, sampled, table)
        return table

    def scores(self, name: str, test: PromptSet, table: torch.Tensor, prefix: str) -> dict[str, float]:
        """The set's scores from its summed table (``eval_scores.set_scores``)."""
        n, count = self.cfg.n, table.shape[0]
        return set_scores(
            name,
            [test.info(i)["data_source"] for i in range(count)],
            table[:, GREEDY].numpy() if self.cfg.greedy else None,
            table[:, SAMPLED:].numpy() if n else None,
            table[:, MAJORITY].numpy() if n else None,
            prefix,
        )

    def count(self, test: PromptSet) -> int:
        return min(self.cfg.limit or len(test), len(test))

    def headline(self, out: dict[str, float], prefix: str) -> float:
        """``<prefix>_accuracy``: the first set's greedy accuracy, or its mean@n without greedy answers."""
        first = next(iter(self.held_out.sets))
        return out[f"{prefix}/{first}/" + ("greedy" if self.cfg.greedy else f"mean@{self.cfg.n}")]

    def _answers(self, test: PromptSet, mine: list[int], n: int, temperature: float, top_p: float | None) -> list[str]:
        """n answers to each of the prompts ``mine`` (prompt-major); sampled ones seeded by the
        prompt's index in its set (module docstring)."""
        seed = self.seed if temperature > 0 else None
        if self.turns is not None:
            items = [(test.prompt_ids[i], test.environment_row(i)) for i in mine for _ in range(n)]
            keys = [i * n + j for i in mine for j in range(n)]
            return [t.last_text for t in self.turns.run(items, seed, temperature, keys, top_p=top_p)]
        samples = self.rollout.generate(
            [test.prompt_ids[i] for i in mine], n, self.max_tokens, temperature, seed, [i * n for i in mine], top_p
        )
        return self.tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)

    def _score(self, test: PromptSet, mine: list[int], greedy: list[str], sampled: list[str], table) -> None:
        """Fill the rows ``mine`` of ``table`` from one pool call over every answer."""
        n = self.cfg.n
        owners = (list(mine) if greedy else []) + [i for i in mine for _ in range(n)]
        scored = pool_of(self.reward, self.held_out.correct).score(
            greedy + sampled, [test.answers[i] for i in owners], [test.info(i) for i in owners]
        )
        right = [s > 0.5 for s in scored.scores]
        if greedy:
            for i, r in zip(mine, right):
                table[i, GREEDY] = float(r)
            right = right[len(mine) :]
        for p, i in enumerate(mine if n else []):
            mine_right = right[p * n : (p + 1) * n]
            table[i, SAMPLED:] = torch.tensor(mine_right, dtype=torch.float64)
            answers = [self.held_out.extract(t) for t in sampled[p * n : (p + 1) * n]]
            table[i, MAJORITY] = float(majority_right(answers, mine_right))


def held_out_for(cfg: Config, tokenizer) -> HeldOut:
    """The sets of ``data.test_path`` read with the run's ``data`` fields, the rule that decides
    an answer is right (``rewards.correctness_for``), and what maj@n votes on (``reward.extract``)."""
    sets = {name: prompts_for(cfg, tokenizer, paths) for name, paths in test_sets(cfg.data.test_path).items()}
    return HeldOut(sets, correctness_for(cfg.reward), EXTRACTORS[cfg.reward.extract])


def eval_due(run: Run, it: int) -> bool:
    """Whether the policy after ``it`` updates is evaluated before iteration ``it``."""
    every = run.cfg.eval.interval
    return run.held_out is not None and it % every == 0 and (it > 0 or run.cfg.eval.before_train)


def evaluate(run: Run, iteration: int, prefix: str = "eval") -> dict[str, float]:
    """Collective over the side: every set's scores of the policy after ``iteration`` updates
    (``<prefix>/<set>/...``) and ``<prefix>_accuracy`` (``Evaluation.headline``)."""
    ev, out = Evaluation.of(run), {}
    g, tp_rank = run.lay.gen.coords(run.peer.rank)
    for name, test in run.held_out.sets.items():
        count = ev.count(test)
        # a generation group's TP ranks produced the same texts: its TP rank 0 scores them
        table = ev.table(test, list(range(g, count, run.lay.gen.dp)), count, score=tp_rank == 0)
        dist.all_reduce(table, group=run.sides.group)
        if run.peer.rank == run.sides.leader:
            record(run.cfg.logging.dir, iteration, name, table, ev.cfg)
        out |= ev.scores(name, test, table, prefix)
    out[f"{prefix}_accuracy"] = ev.headline(out, prefix)
    return out


def record(log_dir: str | Path, iteration: int, name: str, table: torch.Tensor, cfg: EvalConfig) -> None:
    """Append the set's per-prompt results to ``<log_dir>/eval_prompts.jsonl`` (module docstring)."""
    folder = Path(log_dir)
    folder.mkdir(parents=True, exist_ok=True)
    line: dict = {"iteration": iteration, "set": name, "prompts": table.shape[0]}
    if cfg.greedy:
        line["correct"] = table[:, GREEDY].nonzero().flatten().tolist()
    if cfg.n:
        line["sampled_right"] = [int(c) for c in table[:, SAMPLED:].sum(dim=1).tolist()]
    with open(folder / RECORD, "a") as f:
        f.write(json.dumps(line) + "\n")
