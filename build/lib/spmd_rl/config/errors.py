"""User-facing configuration errors: each violation names the field, the value and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Violation:
    """One broken rule. Rendered as ``field=value: problem -> fix`` on one line."""

    field: str
    value: Any
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}={self.value!r}: {self.problem} -> {self.fix}"


class ConfigError(Exception):
    """Raised with every violation found, so a user fixes them all in one round (exit code 2)."""

    exit_code = 2

    def __init__(self, violations: list[Violation], source: str = "config"):
        self.violations = violations
        self.source = source
        lines = "\n".join(f"  - {v}" for v in violations)
        super().__init__(f"{source}: {len(violations)} problem(s)\n{lines}")
