"""docs/extending.md shows the code that is tested: its algorithm example is, line for line,
the module the algorithm tests import (tests/helpers/algorithms.py), and it loads as a spec;
its rollout engine example is tests/helpers/rollouts.py, built by name through the registry;
its reward and environment examples are functions of tests/helpers/rewards.py and envs.py, run
through the reward stage and the environment factory."""

from __future__ import annotations

import re

import pytest

from spmd_rl.algos.specs import spec_named
from tests.conftest import REPO


def test_the_algorithm_example_is_the_tested_module():
    doc = (REPO / "docs/extending.md").read_text()
    block = re.search(r"## An algorithm.*?```python\n(.*?)```", doc, re.S).group(1)
    module = (REPO / "tests/helpers/algorithms.py").read_text()
    body = module[module.index("from spmd_rl.algos.specs") :]
    assert block == body, "docs/extending.md's example differs from tests/helpers/algorithms.py"
    assert spec_named("tests.helpers.algorithms:MEDIAN").estimator == "tests.helpers.algorithms:median_baseline"


def test_the_rollout_engine_example_is_the_tested_module_and_builds_by_name():
    from spmd_rl.config.schema import RolloutConfig
    from spmd_rl.distributed.accelerator import detect
    from spmd_rl.engines.base import RolloutBuild
    from spmd_rl.engines.rollouts import build_rollout_engine

    doc = (REPO / "docs/extending.md").read_text()
    block = re.search(r"## A rollout engine.*?```python\n(.*?)```", doc, re.S).group(1)
    module = (REPO / "tests/helpers/rollouts.py").read_text()
    assert block == module[module.index("from spmd_rl.engines.base") :], "the rollout example differs"
    cfg = RolloutConfig(engine="tests.helpers.rollouts:EchoRollout", n=2, max_response_length=3)
    engine = build_rollout_engine(RolloutBuild("unused", detect("cpu"), cfg, 1, "float32", 16))
    got = engine.generate([[5, 6], [7]], n=2, max_tokens=3, seed=0)
    assert [s.token_ids for s in got] == [[6, 6, 6]] * 2 + [[7, 7, 7]] * 2
    with pytest.raises(ValueError, match="cannot serve this run: adapters"):
        build_rollout_engine(RolloutBuild("unused", detect("cpu"), cfg, 1, "float32", 16, lora=object()))


def _example(section: str) -> str:
    doc = (REPO / "docs/extending.md").read_text()
    return re.search(rf"## {section}.*?```python\n(.*?)```", doc, re.S).group(1)


def test_the_reward_example_is_the_tested_function_and_the_reward_stage_scores_with_it(tiny_model):
    """Through the reward stage's own call: three arguments, the row read from the prompt set
    by each sample's ``prompt_row`` (a rule written to another signature raises here, not
    after a user's first rollout), the dict's score as the reward and its metric summed, and
    the per-source sums of a dataset with two sources."""

    import torch
    from transformers import AutoTokenizer

    from spmd_rl.config.loader import load_config
    from spmd_rl.data.prompts import PromptSet
    from spmd_rl.dock.batch import DockBatch
    from spmd_rl.rewards import get_reward
    from spmd_rl.trainer.stages.registry import StageCall, StageView
    from spmd_rl.trainer.stages.reward import reward
    from spmd_rl.trainer.stages.samples import encode_text

    assert _example("A reward rule") in (REPO / "tests/helpers/rewards.py").read_text()
    cfg = load_config(
        REPO / "configs/quickstart.yaml", [f"model.path={tiny_model}", "reward.rule=tests.helpers.rewards:last_number"]
    )
    tok = AutoTokenizer.from_pretrained(tiny_model)
    responses = ["3+4=7", "7", "3+4=8", "3+4=7"]
    ids = [torch.tensor(tok(r, add_special_tokens=False).input_ids) for r in responses]
    assert tok.batch_decode(ids, skip_special_tokens=True) == responses
    columns = {
        "response_ids": ids,
        "answer": [encode_text("7")] * 4,
        "response_length": [torch.tensor(len(i), dtype=torch.int32) for i in ids],
        "prompt_row": [torch.tensor(r) for r in (0, 0, 0, 1)],  # the last sample's prompt is a "strict" row
    }
    batch = DockBatch(torch.arange(4), columns, frozenset({"response_ids", "answer"}))
    prompts = PromptSet([[1], [2]], ["7", "7"], [0, 1], ["a", "b"], sources=["loose", "strict"], extras=[{}, {}])
    rule = get_reward(cfg.reward.rule, cfg.reward.format_score)
    view = StageView(cfg=cfg, tokenizer=tok, reward_fn=rule, prompts=prompts)
    got = reward(StageCall(view, 0, None, batch, True, [0, 1, 2, 3]))
    assert got.columns["reward"].tolist() == [1.0, 1.0, 0.0, 0.0] and got.sums["correct"] == 2.0
    assert got.sums["reward_extra/has_number"] == 3.0  # "3+4=7" under "strict" holds no lone number
    assert (got.sums["source/loose/correct"], got.sums["source/strict/generated"]) == (2.0, 1.0)
    assert get_reward("exact_match")("3+4=7", "7") == 0.0  # what the example is for


def test_the_environment_example_is_the_tested_class_and_plays_by_name():
    from spmd_rl.envs.base import Turn
    from spmd_rl.envs.factory import environment_factory

    assert _example("A multi-turn environment") in (REPO / "tests/helpers/envs.py").read_text()
    env = environment_factory("tests.helpers.envs:countdown")({"prompt": "3+4=", "answer": "7"})
    first = env.step(Turn("let me count", (1, 2)))
    assert (first.observation, first.done, first.metadata) == ("1 turn(s) left", False, {"tool_calls": 1})
    last = env.step(Turn(" 7 ", (3,)))
    assert (last.observation, last.reward, last.done) == (None, 0.1, True)
