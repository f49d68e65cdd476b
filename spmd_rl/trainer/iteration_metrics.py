"""One iteration's metrics, gathered from the stages' results (``StageResult``): sums are
summed over ranks (each sample counted by its writer only), maxima maxed over ranks, final
values taken as they are. ``finish`` derives the per-sample and per-token means."""

from __future__ import annotations

from spmd_rl.envs.trajectory import STATS
from spmd_rl.gateway.records import AGENT_STATS
from spmd_rl.trainer.metrics import global_maxes, global_sums
from spmd_rl.trainer.stages import StageResult

_MEANS = {  # metric: (sum, count) of the global sums
    "reward_mean": ("reward_sum", "generated"),
    "accuracy": ("correct", "generated"),
    "response_length_mean": ("response_tokens", "generated"),
    "reward_model_mean": ("reward_model_sum", "generated"),
    "reward_rule_mean": ("reward_rule_sum", "generated"),
    "kl_reward": ("kl_reward_sum", "kl_reward_tokens"),
    "values_mean": ("values_sum", "value_tokens"),
    "returns_mean": ("returns_sum", "value_tokens"),
    "env_reward_mean": ("env_reward_sum", "generated"),
}
_COUNTS = tuple(k for k in STATS if k not in ("turns", "trajectories"))
"""Multi-turn counts reported as iteration totals: tool calls, errors, timeouts, truncations,
prefix breaks, sampled and inserted tokens (``envs.trajectory.STATS``)."""


def turn_metrics(g: dict[str, float]) -> dict[str, float]:
    """Multi-turn metrics from the summed counts of the trajectories that ended (none single-turn)."""
    if "turns" not in g:
        return {}
    counts = _COUNTS + ("trajectories",) + tuple(k for k in AGENT_STATS if k in g)
    return {"turns_mean": g["turns"] / max(g["trajectories"], 1.0)} | {k: g[k] for k in counts}


class IterationMetrics:
    def __init__(self, group) -> None:
        """``group``: the ranks the sums and maxima are reduced over (``Run.sides.group``)."""
        self.group = group
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}
        self.final: dict[str, float] = {}

    def add(self, result: StageResult) -> None:
        for k, v in result.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        for k, v in result.maxes.items():
            self.maxes[k] = max(self.maxes.get(k, v), v)
        self.final |= result.final

    def finish(self) -> dict[str, float]:
        """Collective: every rank calls it with the same keys."""
        g = global_sums(self.sums, self.group)
        n = max(1.0, g.get("generated", 0.0))
        out = {name: g[s] / max(1.0, g[c]) for name, (s, c) in _MEANS.items() if s in g and c in g}
        if "reward_sq" in g:  # absent when no group was rewarded (partial rollout with none finished)
            out["reward_std"] = max(0.0, g["reward_sq"] / n - out["reward_mean"] ** 2) ** 0.5
        out |= {"generated_samples": n, "adv_zero_groups": g.get("adv_zero_groups", 0.0)}
        out |= {k: g[k] for k in ("reward_failures", "reward_timeouts") if k in g}  # counts over the side
        if "resid_sq" in g:  # verl's vf_explained_var: 1 - Var(R - V) / Var(R) over every response token
            t = max(1.0, g["value_tokens"])
            var_r = g["returns_sq"] / t - (g["returns_sum"] / t) ** 2
            var_e = g["resid_sq"] / t - (g["resid_sum"] / t) ** 2
            out["value_explained_var"] = 1.0 - var_e / var_r if var_r > 0 else 0.0
        out |= turn_metrics(g)
        out |= {f"reward/{k.split('/', 1)[1]}": v / n for k, v in g.items() if k.startswith("reward_extra/")}
        for k, v in g.items():  # per data_source (stages.reward.source_sums)
            if k.startswith("source/") and k.endswith("/generated"):
                source = k[len("source/") : -len("/generated")]
                out[f"reward/{source}"] = g[f"source/{source}/reward"] / max(v, 1.0)
                out[f"accuracy/{source}"] = g[f"source/{source}/correct"] / max(v, 1.0)
        out |= global_maxes(self.maxes, self.group)
        return out | self.final
