"""docs/extending.md shows the code that is tested: its algorithm example is, line for line,
the module the algorithm tests import (tests/helpers/algorithms.py), and it loads as a spec."""

from __future__ import annotations

import re

from spmd_rl.algos.specs import spec_named
from tests.conftest import REPO


def test_the_algorithm_example_is_the_tested_module():
    doc = (REPO / "docs/extending.md").read_text()
    block = re.search(r"## An algorithm.*?```python\n(.*?)```", doc, re.S).group(1)
    module = (REPO / "tests/helpers/algorithms.py").read_text()
    body = module[module.index("from spmd_rl.algos.specs") :]
    assert block == body, "docs/extending.md's example differs from tests/helpers/algorithms.py"
    assert spec_named("tests.helpers.algorithms:MEDIAN").estimator == "tests.helpers.algorithms:median_baseline"
