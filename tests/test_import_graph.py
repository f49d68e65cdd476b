"""Dependencies point down: no module of spmd_rl imports, directly or through others, a module
that imports it back. Every import counts, ``TYPE_CHECKING`` and function-level ones included
(a lazy import only hides a circle)."""

from __future__ import annotations

import ast

from tests.conftest import REPO

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
