"""What a config can name, at the bottom of the house: name -> implementation tables (verl's
``register_policy_loss`` pattern, its lazy engine registry) and the resolution of a user's
``module:attribute``. Imports nothing of the package and no torch.

A table entry is either registered (the object itself, ``register``) or declared (``declare``:
a ``"module:attribute"`` string imported at its first ``lookup``, with metadata that torch-free
code, ``spmd-rl validate`` and ``plan``, reads without importing it). So a table is declared
once, where the config check can read it, and there is no second list of its names to keep in
step. A name registers once; an unknown name is an error that lists the registered ones; a name
with a colon is a user's ``module:attribute``, imported from the user's own module (no
registration, no edit to the package)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any, Generic, TypeVar

F = TypeVar("F")


class Registry(dict[str, F], Generic[F]):
    def __init__(self, kind: str, hint: str = ""):
        """``kind`` names what is registered in errors; ``hint`` says how to add one."""
        super().__init__()
        self.kind, self.hint = kind, hint
        self.meta: dict[str, Any] = {}
        """Per declared name, what its ``declare`` gave (None when nothing)."""

    def _add(self, name: str, entry) -> None:
        if name in self:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self[name] = entry

    def register(self, *names: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            for name in names:
                self._add(name, fn)
            return fn

        return add

    def declare(self, name: str, target: str, meta: Any = None) -> None:
        """``name`` -> ``target`` (``"module:attribute"``), imported at the first ``lookup``."""
        self._add(name, target)
        self.meta[name] = meta

    def lookup(self, name: str) -> F:
        if ":" in name:
            return user_function(name, f"{self.kind} {name!r}")
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self))}{self.hint}")
        found = self[name]
        if isinstance(found, str):  # declared: import it now, once
            found = self[name] = resolve(found, f"{self.kind} {name!r}")
        return found


def _attribute(path: str):
    """The attribute ``module:attribute`` names, imported; None when the module lacks it."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr, None)


def resolve(path: str, what: str) -> Any:
    """The attribute ``module:attribute`` names, imported; ValueError naming ``what`` when the
    module lacks it."""
    found = _attribute(path)
    if found is None:
        module, _, attr = path.partition(":")
        raise ValueError(f"{what}: {module} has no attribute {attr!r}")
    return found


def user_function(path: str, what: str) -> Callable:
    """A user's ``module:function``, imported; ValueError ``<what>: <module> has no function``
    when the module lacks it."""
    fn = _attribute(path)
    if not callable(fn):
        module, _, attr = path.partition(":")
        raise ValueError(f"{what}: {module} has no function {attr!r}")
    return fn


def is_command_line(spec: str) -> bool:
    """A user's command line (white space or a path) rather than a ``module:function`` (neither)."""
    return any(c.isspace() for c in spec) or "/" in spec


def findable(path: str) -> bool:
    """``module:attribute`` whose module can be found on the path, without importing it (the
    torch-free config check of a user's function: the ranks import it)."""
    module, sep, attr = path.partition(":")
    try:
        return bool(sep and module) and attr.isidentifier() and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
