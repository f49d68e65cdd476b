"""One line of ``spmd-rl doctor``'s report: what a check saw, and the fix when it failed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False

    def line(self) -> str:
        tag = "FAIL" if not self.ok else "warn" if self.warn else "ok"
        return f"{tag:4s}  {self.name}: {self.detail}" + (f" -> {self.fix}" if self.fix else "")
