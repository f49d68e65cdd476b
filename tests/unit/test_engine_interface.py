"""Dependencies point at the engine interface: only the composition root (``spmd_rl/train.py``)
names the FSDP engine class; the resharder, the stages, the update, the loop and the
checkpoint code import ``engines.base`` at most. And the FSDP engine implements the whole
interface (an abstract method left out would make it uninstantiable)."""

from __future__ import annotations

import ast
import inspect

from spmd_rl.engines.base import Engine
from spmd_rl.engines.fsdp.engine import TrainEngine
from tests.conftest import REPO

CONSUMERS = ["spmd_rl/reshard", "spmd_rl/trainer"]


def imported_modules(path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_consumers_depend_on_the_interface_not_the_fsdp_class():
    offenders = {
        str(p.relative_to(REPO))
        for d in CONSUMERS
        for p in (REPO / d).glob("*.py")
        if "spmd_rl.engines.fsdp.engine" in imported_modules(p)
    }
    assert not offenders, f"import engines.base instead of the FSDP engine in {sorted(offenders)}"


def test_fsdp_engine_implements_the_interface():
    assert issubclass(TrainEngine, Engine)
    assert not inspect.isabstract(TrainEngine)
    assert Engine.__abstractmethods__ >= {
        "infer",
        "train_step",
        "weight_shapes",
        "full_weights",
        "param_tensors",
        "grad_tensors",
        "optimizer_tensors",
        "save",
        "load",
    }
