"""Memory ledger: bytes per category at each named phase, for measuring (not asserting) the
saving of allgather-swap against the naive path (paper Eq. (3) plus the swapped optimizer and
gradient state)."""

from __future__ import annotations

from dataclasses import dataclass, field

CATEGORIES = ("train_params", "train_grads", "train_optim", "gen_weights", "temp", "kv_cache")


@dataclass
class Ledger:
    rows: list[tuple[str, dict[str, int]]] = field(default_factory=list)

    def record(self, phase: str, **bytes_by_category: int) -> None:
        unknown = set(bytes_by_category) - set(CATEGORIES)
        if unknown:
            raise ValueError(f"unknown ledger categories {sorted(unknown)}")
        self.rows.append((phase, {c: int(bytes_by_category.get(c, 0)) for c in CATEGORIES}))

    def total(self, phase: str) -> int:
        """Total of the last row recorded for ``phase``."""
        for name, row in reversed(self.rows):
            if name == phase:
                return sum(row.values())
        raise KeyError(f"no ledger row for phase {phase!r}")

    def peak(self) -> int:
        return max((sum(r.values()) for _, r in self.rows), default=0)

    def table(self) -> str:
        head = f"{'phase':<24}" + "".join(f"{c:>14}" for c in CATEGORIES) + f"{'total':>14}"
        lines = [head] + [f"{p:<24}" + "".join(f"{r[c]:>14,}" for c in CATEGORIES) + f"{sum(r.values()):>14,}" for p, r in self.rows]
        return "\n".join(lines)
