"""The ``eval`` section's fields reach the engine and the scores (``trainer.evaluate``). The
engine is a recording stand-in that answers by a rule; what the real engines do with a
request's ``top_p`` is tested beside them (test_rollout_fields, test_hf_rollout)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spmd_rl.config.runtime_schema import EvalConfig
from spmd_rl.config.schema import RewardConfig
from spmd_rl.data.prompts import PromptSet
from spmd_rl.data.sampling import Sample
from spmd_rl.rewards import get_reward
from spmd_rl.rewards.extract import EXTRACTORS
from spmd_rl.trainer.context import HeldOut
from spmd_rl.trainer.evaluate import Evaluation, eval_due


class Recording:
    """Answers "<prompt id>" greedily and "<seed parity>" when sampled; records each call."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, max_tokens, temperature, seed, seed_keys, top_p):
        self.calls.append({"n": n, "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "top_p": top_p})
        if temperature == 0:
            return [Sample([p[0]], [0.0]) for p in prompts]
        return [Sample([(k + j) % 2], [0.0]) for k in seed_keys for j in range(n)]


class Decode:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(i[0]) for i in ids]


def _evaluation(cfg: EvalConfig, engine: Recording) -> tuple[Evaluation, PromptSet]:
    test = PromptSet([[0], [1], [0], [1]], ["0", "0", "1", "1"], [0, 1, 2, 3], texts=["a", "b", "c", "d"])
    held = HeldOut({"t": test}, get_reward("exact_match"), EXTRACTORS["strict"])
    return Evaluation(cfg, RewardConfig(workers=1), held, engine, Decode(), None, 7, cfg.max_tokens or 5), test


def test_the_eval_fields_reach_the_engine_and_the_scores():
    engine = Recording()
    cfg = EvalConfig(interval=1, n=2, temperature=0.6, top_p=0.3, max_tokens=11, greedy=False, limit=3)
    ev, test = _evaluation(cfg, engine)
    table = ev.table(test, [0, 1, 2], ev.count(test))
    assert engine.calls == [{"n": 2, "max_tokens": 11, "temperature": 0.6, "seed": 7, "top_p": 0.3}]  # no greedy call
    out = ev.scores("t", test, table, "eval")
    assert "eval/t/greedy" not in out and out["eval/t/prompts"] == 3  # eval.limit
    # sampled answers (k*2 + j) % 2 = j: "0" then "1" for every prompt: each prompt 1 of 2 right
    assert out["eval/t/mean@2"] == 0.5 and out["eval/t/pass@2"] == 1.0
    # a tie votes for the answer seen first, "0": right for prompts 0 and 1 only
    assert out["eval/t/maj@2"] == pytest.approx(2 / 3)
    assert ev.headline(out, "eval") == 0.5  # mean@n without greedy answers


def test_greedy_answers_are_scored_and_head_the_metrics():
    engine = Recording()
    ev, test = _evaluation(EvalConfig(interval=1), engine)
    out = ev.scores("t", test, ev.table(test, [0, 1, 2, 3], 4), "eval")
    assert [c["temperature"] for c in engine.calls] == [0.0] and engine.calls[0]["seed"] is None
    assert out["eval/t/greedy"] == 0.5 and ev.headline(out, "eval") == 0.5 and "eval/t/mean@1" not in out


def test_before_train_decides_iteration_zero():
    run = SimpleNamespace(held_out=object(), cfg=SimpleNamespace(eval=EvalConfig(interval=2)))
    assert [eval_due(run, it) for it in range(5)] == [True, False, True, False, True]
    run.cfg.eval = EvalConfig(interval=2, before_train=False)
    assert [eval_due(run, it) for it in range(5)] == [False, False, True, False, True]
