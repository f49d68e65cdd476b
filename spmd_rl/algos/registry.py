"""Name -> function tables (verl's ``register_policy_loss`` pattern), shared by the policy and
value losses and the trainer's stages. A name registers once; an unknown name is an error that
lists the registered ones."""

from __future__ import annotations

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
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self))}{self.hint}")
        return self[name]
