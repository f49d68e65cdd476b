"""User environments (``rollout.environment: tests.helpers.envs:<name>``) for the multi-turn
torchrun tests, loaded by the run the way a user's own are."""

from __future__ import annotations

import os
import time
from pathlib import Path

from spmd_rl.envs.base import Step, Turn


class Echo:
    """One tool turn ("ok"), then done. With ``SPMD_RL_TEST_MARK`` set, each step touches
    <mark>/<pid>: the test knows which rank is inside a multi-turn rollout, and when."""

    def __init__(self, row: dict):
        self.calls = 0

    def step(self, turn: Turn) -> Step:
        mark = os.environ.get("SPMD_RL_TEST_MARK")
        if mark:
            Path(mark, str(os.getpid())).touch()
        self.calls += 1
        if self.calls > 1:
            return Step(done=True)
        time.sleep(float(os.environ.get("SPMD_RL_TEST_TOOL_SLEEP", "0")))
        return Step(observation="ok", metadata={"tool_calls": 1})


def echo(row: dict) -> Echo:
    return Echo(row)
