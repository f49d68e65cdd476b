"""Dependencies point at the engine interface: no module names an engine class but the
registries that declare them (``recipe.train_backends``, ``config.rollout_engines``, by
``module:attr`` string); the resharder, the elastic replicas and every module under ``trainer/``
(its stages included) import ``engines.base`` at most, never a concrete engine's package. And
every registered training backend's engine implements the whole interface itself (each
abstract method overridden, so it is instantiable and nothing falls back to a stub)."""

from __future__ import annotations

import ast
import inspect

import pytest

from spmd_rl.catalog import user_function
from spmd_rl.engines.base import Engine
from spmd_rl.recipe.train_backends import TRAIN_BACKENDS
from tests.conftest import REPO

CONSUMERS = ["spmd_rl/reshard", "spmd_rl/trainer", "spmd_rl/elastic"]
CONCRETE = tuple(f"spmd_rl.engines.{name}" for name in ("fsdp", "megatron", "vllm", "hf"))


def imported_modules(path) -> set[str]:
    """Every module a file imports, ``from a.b import c`` as both ``a.b`` and ``a.b.c``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def offenders(root=REPO) -> set[str]:
    return {
        str(p.relative_to(root))
        for d in CONSUMERS
        for p in (root / d).rglob("*.py")
        if any(m == c or m.startswith(c + ".") for m in imported_modules(p) for c in CONCRETE)
    }


def test_consumers_depend_on_the_interface_not_an_engine():
    assert (REPO / "spmd_rl/trainer/stages/actor_update.py") in set((REPO / "spmd_rl/trainer").rglob("*.py"))
    found = offenders()
    assert not found, f"import engines.base instead of a concrete engine in {sorted(found)}"


def test_the_check_finds_a_stage_that_imports_an_engine(tmp_path):
    stage = tmp_path / "spmd_rl/trainer/stages/x.py"
    stage.parent.mkdir(parents=True)
    stage.write_text("from spmd_rl.engines.fsdp import engine\n")
    assert offenders(tmp_path) == {"spmd_rl/trainer/stages/x.py"}


@pytest.mark.parametrize("backend", sorted(TRAIN_BACKENDS))
def test_every_backends_engine_implements_the_interface_itself(backend):
    cls = user_function(TRAIN_BACKENDS[backend].engine, backend)
    assert issubclass(cls, Engine) and not inspect.isabstract(cls)
    assert {"infer", "train_step", "full_weights", "save", "load"} <= Engine.__abstractmethods__
    inherited = sorted(m for m in Engine.__abstractmethods__ if getattr(cls, m) is getattr(Engine, m))
    assert not inherited, f"{cls.__name__} does not implement {inherited}"
