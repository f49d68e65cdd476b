"""Every program under tests/helpers starts by asking the suite's preload servers for a forked copy
(``spmd_rl.launcher.preload.delegate``) before it imports anything else: a program that does
not imports torch, transformers and vLLM itself, about 30 CPU-seconds per process on a 2-core
AVX2-only EPYC. Four helpers had lost it (the engine worker, the partial-rollout helpers and the
one-prompt probe); this finds the next one. A program is a helper file that nothing imports as
``tests.helpers.<name>``; the others (rewards, algorithms, environments, a user's rollout
engine) are loaded by the runs under test as a user's modules are."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

HELPERS = REPO / "tests" / "helpers"


def imported_as_modules() -> set[str]:
    """Helper names some file of the repository names as ``tests.helpers.<name>``."""
    names = set()
    for folder in ("tests", "configs", "docs", "spmd_rl", "tools"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".yaml") and path.is_file():
                names |= set(re.findall(r"tests\.helpers\.(\w+)", path.read_text()))
    return names


def programs() -> list[Path]:
    libraries = imported_as_modules()
    return sorted(p for p in HELPERS.glob("*.py") if p.stem not in libraries)


def delegates_first(path: Path) -> bool:
    """The module's statements after its docstring: imports from spmd_rl.engines.vllm.logs and
    spmd_rl.launcher.preload only (both import nothing heavy), then the ``delegate(...)`` call."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    for stmt in body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module in (
            "spmd_rl.engines.vllm.logs",
            "spmd_rl.launcher.preload",
        ):
            continue
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        return isinstance(call, ast.Call) and getattr(call.func, "id", None) == "delegate"
    return False


def test_the_split_into_programs_and_libraries_is_what_the_helpers_are():
    names = {p.stem for p in programs()}
    assert {"engine_worker", "moe_routes", "vllm_one_prompt", "partial_stage"} <= names
    assert not names & {"rewards", "algorithms", "envs", "rollouts"}


def test_every_helper_program_delegates_before_its_imports():
    missing = [p.name for p in programs() if not delegates_first(p)]
    assert not missing, f"tests/helpers programs that import for themselves (add preload.delegate first): {missing}"


def test_the_check_tells_a_late_delegate_from_a_first_one(tmp_path):
    late = tmp_path / "late.py"
    late.write_text('"""doc"""\nimport torch\nfrom spmd_rl.launcher.preload import delegate\ndelegate()\n')
    first = tmp_path / "first.py"
    first.write_text('"""doc"""\nfrom spmd_rl.launcher.preload import delegate\ndelegate()\nimport torch\n')
    assert not delegates_first(late) and delegates_first(first)
