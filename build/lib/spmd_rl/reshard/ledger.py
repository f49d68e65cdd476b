"""Memory ledger: this rank's resident bytes per role and category, one row per named phase
(each stage's entry, each step of a reshard). It measures; it asserts nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

CATEGORIES = (
    "actor_params",
    "actor_grads",
    "actor_optim",
    "ref_params",
    "critic_params",
    "critic_grads",
    "critic_optim",
    "reward_model_params",
    "rollout_weights",
    "kv_cache",
    "temp",
)

ROLE_CATEGORIES = {
    "actor": ("actor_params", "actor_grads", "actor_optim"),
    "ref": ("ref_params",),
    "critic": ("critic_params", "critic_grads", "critic_optim"),
    "reward_model": ("reward_model_params",),
    "rollout": ("rollout_weights", "kv_cache"),
}
"""Which categories belong to which role (``temp`` is the gather bucket, nobody's state)."""


@dataclass
class Ledger:
    rows: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    keep: int = 4096
    """Most rows kept (the oldest go first), so a long run's ledger stays small."""

    def record(self, phase: str, **bytes_by_category: int) -> None:
        unknown = set(bytes_by_category) - set(CATEGORIES)
        if unknown:
            raise ValueError(f"unknown ledger categories {sorted(unknown)}")
        self.rows.append((phase, {c: int(bytes_by_category.get(c, 0)) for c in CATEGORIES}))
        del self.rows[: -self.keep]

    def last(self, phase: str) -> dict[str, int]:
        """The last row recorded for ``phase``."""
        for name, row in reversed(self.rows):
            if name == phase:
                return row
        raise KeyError(f"no ledger row for phase {phase!r}")

    def total(self, phase: str) -> int:
        """Total of the last row recorded for ``phase``."""
        return sum(self.last(phase).values())

    def resident_roles(self, phase: str) -> set[str]:
        """Roles with any byte resident in the last row of ``phase``."""
        row = self.last(phase)
        return {role for role, cats in ROLE_CATEGORIES.items() if any(row[c] for c in cats)}

    def peak(self) -> int:
        return max((sum(r.values()) for _, r in self.rows), default=0)

    def table(self) -> str:
        cols = [c for c in CATEGORIES if any(r[c] for _, r in self.rows)] or list(CATEGORIES)
        head = f"{'phase':<24}" + "".join(f"{c:>20}" for c in cols) + f"{'total':>14}"
        lines = [head] + [
            f"{p:<24}" + "".join(f"{r[c]:>20,}" for c in cols) + f"{sum(r.values()):>14,}" for p, r in self.rows
        ]
        return "\n".join(lines)
