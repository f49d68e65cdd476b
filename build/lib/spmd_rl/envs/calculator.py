"""The built-in ``calculator`` environment: a policy that writes ``<calc>EXPR</calc>`` gets the
value of EXPR back as a tool turn; a turn without a call ends the trajectory (its answer is
scored by the reward rule). EXPR is integer arithmetic (+ - * // % and parentheses, unary
minus), evaluated from its syntax tree: nothing of the model's text is executed, so it needs no
sandbox. A malformed or too large expression is an error observation, not a crash."""

from __future__ import annotations

import ast
import operator
import re

from spmd_rl.envs.base import Step, Turn, register_environment

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
MAX_DIGITS = 100


def evaluate(expr: str) -> int:
    """The value of an integer arithmetic expression; ValueError on anything else."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            out = _OPS[type(node.op)](value(node.left), value(node.right))
            if abs(out) >= 10**MAX_DIGITS:
                raise ValueError(f"result over {MAX_DIGITS} digits")
            return out
        raise ValueError(f"not integer arithmetic: {ast.dump(node)[:60]}")

    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expr.strip()[:40]!r}") from exc
    return value(tree.body)


class Calculator:
    def __init__(self, row: dict):
        self.row = row

    def step(self, turn: Turn) -> Step:
        calls = CALL.findall(turn.text)
        if not calls:
            return Step(done=True)
        try:
            return Step(observation=str(evaluate(calls[-1])), metadata={"tool_calls": 1})
        except (ValueError, ZeroDivisionError) as exc:
            return Step(observation=f"error: {exc}", metadata={"tool_calls": 1, "tool_errors": 1})


register_environment("calculator")(Calculator)
