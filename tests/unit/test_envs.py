"""The multi-turn environments' interface and built-ins (spmd_rl.envs): lookup by name or
module:function, the calculator's arithmetic against Python's own, and a python tool whose
failures come back as observations."""

from __future__ import annotations

import pytest

from spmd_rl.envs.base import Step, Turn
from spmd_rl.envs.calculator import evaluate
from spmd_rl.envs.factory import environment_factory


def turn(text: str) -> Turn:
    return Turn(text, tuple(range(len(text))))


def test_lookup_by_name_and_module_function():
    assert environment_factory("calculator").__name__ == "Calculator"
    assert environment_factory("tests.unit.test_envs:echo")({"prompt": "p"}).step(turn("hi")).observation == "hi"
    with pytest.raises(ValueError, match="unknown environment 'nope'; registered: calculator, python"):
        environment_factory("nope")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        environment_factory("tests.unit.test_envs:missing")


def echo(row: dict):
    class Echo:
        def step(self, t: Turn) -> Step:
            return Step(observation=t.text, done=True)

    return Echo()


@pytest.mark.parametrize("expr", ["123456789 * 987654321", "-(7 - 10) * 4 // 3", "2 * (3 + 4) % 5", "10 - -3"])
def test_calculator_is_integer_arithmetic(expr):
    assert evaluate(expr) == eval(expr)  # noqa: S307  (the test's own literals)


@pytest.mark.parametrize(
    "expr,problem",
    [
        ("__import__('os')", "not integer arithmetic"),
        ("2 ** 10", "not integer arithmetic"),
        ("1.5 + 1", "not integer arithmetic"),
        ("9" * 60 + " * " + "9" * 60, "over 100 digits"),
        ("1 +", "cannot parse"),
    ],
)
def test_calculator_refuses_anything_else(expr, problem):
    env = environment_factory("calculator")({})
    step = env.step(turn(f"let me compute <calc>{expr}</calc>"))
    assert not step.done and step.observation.startswith("error:") and problem in step.observation
    assert step.metadata == {"tool_calls": 1, "tool_errors": 1}


def test_calculator_answers_a_call_and_ends_without_one():
    env = environment_factory("calculator")({"prompt": "12345*6789=", "answer": "83810205"})
    assert env.step(turn("<calc>12345*6789</calc>")) == Step(observation="83810205", metadata={"tool_calls": 1})
    assert env.step(turn("83810205")).done


def test_the_python_tool_reports_failures_and_goes_on():
    env = environment_factory("python")({})
    ok = env.step(turn("```python\nprint(6 * 7)\n```"))
    assert ok.observation == "42\n" and ok.metadata == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}
    boom = env.step(turn("```python\nraise RuntimeError('no')\n```"))
    assert (
        "RuntimeError: no" in boom.observation
        and boom.observation.endswith("[error]")
        and boom.metadata["tool_errors"] == 1
    )
    assert env.step(turn("the answer is 42")).done
