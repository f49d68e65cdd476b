"""Dependencies point down: no module of spmd_rl imports, directly or through others, a module
that imports it back. Every import counts, ``TYPE_CHECKING`` and function-level ones included
(a lazy import only hides a circle)."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO
from tools import house_census

PKG = REPO / "spmd_rl"


def _module(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
            if isinstance(node, ast.ImportFrom) and node.module:  # `from pkg import module`
                targets += [f"{node.module}.{a.name}" for a in node.names]
            deps |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_circle():
    graph = _graph()
    assert (
        "spmd_rl.dock.fetch" in graph["spmd_rl.dock.relay"] and "spmd_rl.dock.client" not in graph["spmd_rl.dock.relay"]
    )
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_no_import_circle_among_the_tools():
    """tools/*.py, whose scripts import a sibling by its bare name (``tools/`` is the script's
    folder), read as ``tools.<name>`` by the census's graph."""
    graph = house_census.import_graph(house_census.sources())
    assert "tools.make_tiny_model" in graph["tools.make_tool_model"]  # the check sees the scripts' imports
    tools = {m: {d for d in deps if d.startswith("tools.")} for m, deps in graph.items() if m.startswith("tools.")}
    cycle = _cycle(tools)
    assert cycle is None, " -> ".join(cycle)


def test_the_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_launcher_and_validate_import_no_torch():
    """``spmd-rl validate`` and ``spmd-rl train`` up to torchrun import neither torch nor vLLM:
    torch alone is about 2 s of every launch (the config's stage graph and rules read the
    algorithms' specs, ``algos.specs``, not the torch modules that implement them)."""
    import subprocess
    import sys

    code = (
        "import sys, spmd_rl.cli, spmd_rl.launcher.local; "
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]", res.stdout


def test_imports_follow_the_layers_docs_design_states():
    """Every package of spmd_rl has a layer in docs/design.md, and every import goes to the
    importer's own package or a lower layer (none to a package beside it: two packages of one
    layer that import each other are one circle away from a loop)."""
    layers, graph = house_census.layers(), _graph()
    top = lambda module: module.split(".")[1] if "." in module else None  # noqa: E731  spmd_rl.x.y -> x
    tops = {top(m) for m in graph} - {None}
    assert tops <= set(layers), f"packages without a layer in docs/design.md: {sorted(tops - set(layers))}"
    upward = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if top(m) and top(d) and top(d) != top(m) and layers[top(d)] >= layers[top(m)]
    )
    assert not upward, "imports reaching up a layer or beside it:\n" + "\n".join(upward)


def test_the_layer_check_finds_an_upward_import(monkeypatch):
    import tests.unit.test_import_graph as me

    monkeypatch.setattr(me, "_graph", lambda: {"spmd_rl.algos.x": {"spmd_rl.trainer.y"}, "spmd_rl.trainer.y": set()})
    try:
        test_imports_follow_the_layers_docs_design_states()
    except AssertionError as e:
        assert "spmd_rl.algos.x -> spmd_rl.trainer.y" in str(e)
    else:
        raise AssertionError("an upward import passed")


def test_the_layer_check_finds_an_import_beside_it(monkeypatch):
    import tests.unit.test_import_graph as me

    beside = {"spmd_rl.trainer.x": {"spmd_rl.report.y", "spmd_rl.trainer.z"}, "spmd_rl.report.y": set()}
    monkeypatch.setattr(me, "_graph", lambda: beside | {"spmd_rl.trainer.z": set()})
    with pytest.raises(AssertionError) as e:
        test_imports_follow_the_layers_docs_design_states()
    assert "spmd_rl.trainer.x -> spmd_rl.report.y" in str(e.value) and "trainer.z" not in str(e.value)
