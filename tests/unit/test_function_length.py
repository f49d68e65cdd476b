"""Functions stay short: no function or method in ``spmd_rl/`` spans more than ``LIMIT`` lines,
from its ``def`` (decorators excluded) to its last line, docstring included. ruff bounds
arguments and statements (pyproject.toml); this bounds what a reader has to hold at once."""

from __future__ import annotations

import ast

from tests.conftest import REPO

LIMIT = 60


def long_functions(source: str, limit: int = LIMIT) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function of ``source`` longer than ``limit`` lines."""
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_of_the_package_is_longer_than_the_limit():
    found = {
        f"{path.relative_to(REPO)}:{line} {name}": length
        for path in sorted((REPO / "spmd_rl").rglob("*.py"))
        for name, line, length in long_functions(path.read_text())
    }
    assert not found, f"functions over {LIMIT} lines (split them): {found}"


def test_the_check_counts_a_nested_function_and_the_docstring():
    body = "\n".join(f"        x{i} = {i}" for i in range(LIMIT - 2))
    source = f'def outer():\n    def inner():\n        """doc."""\n{body}\n    return inner\n'
    assert long_functions(source) == [("outer", 1, LIMIT + 2)]  # inner: exactly LIMIT lines, allowed
    assert long_functions(source, LIMIT - 1) == [("outer", 1, LIMIT + 2), ("inner", 2, LIMIT)]
