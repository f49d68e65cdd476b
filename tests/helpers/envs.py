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


class Countdown:
    """Answers each turn with how many turns are left; done after ``turns`` of them, with a
    reward of 0.1 when the last turn repeats the row's answer."""

    def __init__(self, row: dict, turns: int = 2):
        self.answer, self.left = str(row["answer"]), turns

    def step(self, turn: Turn) -> Step:
        self.left -= 1
        if self.left == 0:
            return Step(reward=0.1 if turn.text.strip() == self.answer else 0.0, done=True)
        return Step(observation=f"{self.left} turn(s) left", metadata={"tool_calls": 1})


def countdown(row: dict) -> Countdown:
    return Countdown(row)
