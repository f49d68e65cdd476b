"""Structural measures of the package, for the "before/after" of a refactor.

    .venv/bin/python tools/house_census.py [--json] [--trace]

Every measure prints with its definition. Imports are read from the whole AST of each file
(module level, function level and ``TYPE_CHECKING`` alike), resolved much as
tests/unit/test_import_graph.py resolves them (see ``import_graph``); a module's package is its first name below
``spmd_rl`` (``spmd_rl.cli`` -> ``cli``), its layer that package's number in docs/design.md.
``--trace`` adds ``entry_to_step``, which runs a one-iteration training job (about 10 s on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG, TOOLS = REPO / "spmd_rl", REPO / "tools"
STACK_ENV = "HOUSE_CENSUS_STACK"
SITECUSTOMIZE = f"""import os, sys
argv = sys.orig_argv
if os.environ.get({STACK_ENV!r}) and "-m" in argv and argv[argv.index("-m") + 1] == "spmd_rl.train":  # a rank
    sys.path.insert(0, {str(TOOLS)!r})
    import house_census
    house_census.record_first_step(os.environ[{STACK_ENV!r}])
"""
TRACE_OVERRIDES = (  # one rank, one iteration of a small batch; hf generation: vLLM's gives the same stack
    "parallel.nproc_per_node=1 parallel.train.dp_shard=1 parallel.gen.dp=1 rollout.engine=hf trainer.iterations=1 "
    "data.global_batch_size=4 rollout.n=2 actor.mini_batch_size=4 actor.micro_batch_size=8 metadata.job=house-census "
    "dock.port=0 logging.progress=false"
).split()


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package(module: str) -> str | None:
    """``spmd_rl.x.y`` -> ``x``; None for modules outside spmd_rl's packages."""
    parts = module.split(".")
    return parts[1] if parts[0] == "spmd_rl" and len(parts) > 1 else None


def layers() -> dict[str, int]:
    """docs/design.md's layer list: package -> layer number (1 is the bottom)."""
    text = (REPO / "docs/design.md").read_text()
    block = text[text.index("<!-- layers -->") : text.index("<!-- /layers -->")]
    pairs = re.findall(r"^(\d+)\. (.+)$", block, re.M)
    return {name.strip(): int(n) for n, names in pairs for name in names.split(",")}


def sources() -> dict[str, Path]:
    """Every module of the tree: spmd_rl/**.py and tools/*.py (as ``tools.<name>``)."""
    return {module_name(p): p for p in [*PKG.rglob("*.py"), *TOOLS.glob("*.py")]}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (``from pkg import mod`` is ``pkg.mod``, as
    ``import pkg.mod`` is; ``from pkg import name`` is ``pkg``). In a tools script, a bare
    ``import make_tiny_model`` is ``tools.make_tiny_model``: its folder is on the path when it runs."""
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [s if (s := f"{node.module}.{a.name}") in modules else node.module for a in node.names]
            else:
                continue
            if name.startswith("tools."):
                targets += [f"tools.{t}" for t in targets]
            deps |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module: the modules on a cycle, grouped by
    mutual reachability."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for d in graph[todo.pop()] - seen:
                seen.add(d)
                todo.append(d)
        reach[start] = seen
    components = {tuple(sorted(m for m in reach[n] if n in reach[m])) for n in graph if n in reach[n]}
    return [list(c) for c in sorted(components)]


def whole_config_functions(modules: dict[str, Path]) -> Counter:
    """Per package, the functions and methods of spmd_rl with a parameter annotated with ``Config``
    (spmd_rl/config/schema.py's top-level class), or unannotated and named ``cfg`` or ``config``
    (a ``cfg: ActorConfig`` takes a section, a ``config: Path`` a file: neither counts)."""
    per = Counter()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                if any(
                    re.search(r"\bConfig\b", ast.unparse(p.annotation)) if p.annotation else p.arg in ("cfg", "config")
                    for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]
                ):
                    per[package(name) or name] += 1
    return per


def record_first_step(out: str) -> None:
    """In a rank: at the first optimizer step, write the stack as [file, function, first line]
    (outermost first) to ``out``."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def hook(optimizer, args, kwargs) -> None:
        frames, f = [], sys._getframe(1)
        while f:
            frames.append([f.f_code.co_filename, f.f_code.co_name, f.f_code.co_firstlineno])
            f = f.f_back
        Path(out).write_text(json.dumps(frames[::-1]))
        handle.remove()

    handle = register_optimizer_step_pre_hook(hook)


def function_lines(path: str, name: str, first: int) -> int:
    """Lines of the def ``name`` whose first line (its first decorator's) is ``first``; 0 for
    code that is no def (a module, a lambda, a comprehension)."""
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            if min(d.lineno for d in [*node.decorator_list, node]) == first:
                return node.end_lineno - first + 1
    return 0


def entry_to_step(layer: dict[str, int]) -> dict:
    """Run ``spmd-rl train`` (configs/quickstart.yaml, TRACE_OVERRIDES) with a sitecustomize that
    records the rank's stack at its first optimizer step (the launcher's frames are in another
    process), and measure the stack's spmd_rl frames, outermost first: ``frames`` (``frames_all``:
    every Python frame), distinct ``files``, ``function_lines`` (the lines of their distinct defs),
    ``climbs`` (frames whose package has a higher layer than the previous frame's) and
    ``revisits`` (frames in a file of an earlier frame but not of the previous one)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        stack_file = Path(tmp) / "stack.json"
        env = {k: v for k, v in os.environ.items() if k != "SPMD_RL_PRELOAD"} | {  # no preload server's copy
            STACK_ENV: str(stack_file),
            "PYTHONPATH": os.pathsep.join([tmp, str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [sys.executable, "-m", "spmd_rl.cli", "train", "configs/quickstart.yaml", "--nproc-per-node", "1"]
        cmd += [*TRACE_OVERRIDES, f"checkpoint.dir={tmp}/ckpt", f"logging.dir={tmp}/logs"]
        start = time.monotonic()
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        if res.returncode or not stack_file.exists():
            sys.exit(f"the traced run failed ({res.returncode}):\n{res.stderr[-4000:]}")
        seconds = time.monotonic() - start
        stack = [(Path(f), name, first) for f, name, first in json.loads(stack_file.read_text())]
    ours = [(f, name, first) for f, name, first in stack if f.is_relative_to(PKG)]
    tops = [layer[package(module_name(f))] for f, _, _ in ours]
    files = [f for f, _, _ in ours]
    return {
        "frames": len(ours),
        "frames_all": len(stack),
        "files": len(set(files)),
        "function_lines": sum(function_lines(str(f), n, first) for f, n, first in set(ours)),
        "climbs": sum(b > a for a, b in zip(tops, tops[1:])),
        "revisits": sum(f in files[: i - 1] and f != files[i - 1] for i, f in enumerate(files) if i),
        "chain": [f"{f.relative_to(REPO)}:{first} {name}" for f, name, first in ours],
        "seconds": round(seconds, 1),
    }


def census(trace: bool) -> dict:
    modules, layer = sources(), layers()
    graph = import_graph(modules)
    ours = {m: p for m, p in modules.items() if m.startswith("spmd_rl")}
    lines = {m: len(p.read_text().splitlines()) for m, p in modules.items()}
    big = max(ours, key=lines.get)
    edges = [(m, d) for m in ours for d in graph[m] if package(m) and package(d)]
    upward = sorted(f"{m} -> {d}" for m, d in edges if layer[package(d)] > layer[package(m)])
    same = Counter(
        f"{package(m)} -> {package(d)}"
        for m, d in edges
        if package(m) != package(d) and layer[package(d)] == layer[package(m)]
    )
    per = whole_config_functions(ours)
    result = {
        "largest_module": {
            "path": str(modules[big].relative_to(REPO)),
            "lines": lines[big],
            "spmd_rl": {"files": len(ours), "lines": sum(lines[m] for m in ours)},
            "tools": {"files": len(modules) - len(ours), "lines": sum(lines.values()) - sum(lines[m] for m in ours)},
        },
        "upward_imports": {"count": len(upward), "imports": upward},
        "same_layer_cross_imports": {"count": sum(same.values()), "pairs": dict(sorted(same.items()))},
        "import_circles": circles(graph),
        "whole_config_functions": {"count": sum(per.values()), "per_package": dict(sorted(per.items()))},
    }
    if trace:
        result["entry_to_step"] = entry_to_step(layer)
    return result


DEFINITIONS = {
    "largest_module": "the .py file of spmd_rl/ with the most lines; all .py files and lines of spmd_rl/ and tools/",
    "upward_imports": "module imports (any in the AST) from a spmd_rl package to one of a higher layer",
    "same_layer_cross_imports": "module imports between two different packages of the same layer, by package pair",
    "import_circles": "import cycles: strongly connected components (> 1 module) of spmd_rl/ + tools/*.py",
    "whole_config_functions": "functions/methods of spmd_rl with a parameter annotated Config, or unannotated and "
    "named cfg/config",
    "entry_to_step": "the rank's stack at its first optimizer step (spmd-rl train, one rank, one iteration): its "
    "spmd_rl frames, files, lines of their distinct defs, steps up a layer, returns to an earlier file",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--trace", action="store_true", help="also measure entry_to_step (runs a training job)")
    args = parser.parse_args()
    result = census(args.trace)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for key, value in result.items():
        print(f"{key}: {DEFINITIONS[key]}")
        show(value, "    ")


def show(value, indent: str) -> None:
    """A dict as ``key: value`` lines, a list as ``- item`` lines (an item that is a list joined by commas)."""
    if isinstance(value, dict):
        for key, v in value.items():
            print(f"{indent}{key}:" + ("" if isinstance(v, dict | list) else f" {v}"))
            if isinstance(v, dict | list):
                show(v, indent + "  ")
    else:
        for item in value or ["(none)"]:
            print(f"{indent}- {', '.join(item) if isinstance(item, list) else item}")


if __name__ == "__main__":
    main()
