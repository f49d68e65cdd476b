"""Every ``from spmd_rl... import name`` in tools/, launch/ and tests/helpers/ names something
the package defines, including imports inside functions (the worker halves of the benchmarks).
Invariant: renaming or removing a library function cannot leave a tool that fails only when a
user runs it (bench_sharded_load and bench_reshard once imported a removed build_meshes)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for d in ("tools", "launch", "tests/helpers") for p in (REPO / d).glob("*.py"))


def project_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every ``from spmd_rl.x import name`` anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("spmd_rl"):
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_project_import_resolves(path):
    missing = []
    for line, module, name in project_imports(path):
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{path.relative_to(REPO)}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)


def test_the_scan_sees_function_level_imports():
    names = {name for _, _, name in project_imports(REPO / "tools" / "bench_reshard.py")}
    assert {"train_mesh", "Resharder", "TrainEngine"} <= names
