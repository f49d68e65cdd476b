"""Name -> function tables (verl's ``register_policy_loss`` pattern), shared by the policy and
value losses and the trainer's stages. A name registers once; an unknown name is an error that
lists the registered ones; a name with a colon is a user's ``module:function``, imported from
the user's own module (no registration, no edit to the package)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(dict[str, F], Generic[F]):
    def __init__(self, kind: str, hint: str = ""):
        """``kind`` names what is registered in errors; ``hint`` says how to add one."""
        super().__init__()
        self.kind, self.hint = kind, hint

    def register(self, *names: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            for name in names:
                if name in self:
                    raise ValueError(f"{self.kind} {name!r} registered twice")
                self[name] = fn
            return fn

        return add

    def lookup(self, name: str) -> F:
        if ":" in name:
            return user_function(name, f"{self.kind} {name!r}")
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self))}{self.hint}")
        return self[name]


def user_function(path: str, what: str) -> Callable:
    """A user's ``module:function``, imported; ValueError ``<what>: <module> has no function``
    when the module lacks it."""
    module, _, attr = path.partition(":")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise ValueError(f"{what}: {module} has no function {attr!r}")
    return fn


def findable(path: str) -> bool:
    """``module:attribute`` whose module can be found on the path, without importing it (the
    torch-free config check of a user's function: the ranks import it)."""
    module, sep, attr = path.partition(":")
    try:
        return bool(sep and module) and attr.isidentifier() and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
