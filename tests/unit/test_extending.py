"""docs/extending.md shows the code that is tested: its algorithm example is, line for line,
the module the algorithm tests import (tests/helpers/algorithms.py), and it loads as a spec;
its rollout engine example is tests/helpers/rollouts.py, built by name through the registry."""

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
