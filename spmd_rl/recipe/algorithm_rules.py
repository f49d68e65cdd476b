"""Algorithm rules: the algorithm's spec against the batch and the actor's objective
(``algorithm.*``, the ``actor`` loss, clip and correction fields)."""

from __future__ import annotations

from pathlib import Path

from spmd_rl.algos.specs import AlgorithmSpec
from spmd_rl.config.errors import Violation
from spmd_rl.config.schema import Config
from spmd_rl.recipe.graph import Modes, algorithm, data_columns, stages_for


def check_algorithm(cfg: Config) -> list[Violation]:
    """The algorithm's spec against the fields it reads: group size, critic, objective terms,
    rollout correction."""
    spec = algorithm(cfg)
    return (
        check_groups(cfg, spec)
        + check_critic_fields(cfg, spec)
        + check_objective_terms(cfg, spec)
        + check_correction(cfg, spec)
        + check_advantage_stage(cfg, spec)
    )


def check_advantage_stage(cfg: Config, spec: AlgorithmSpec) -> list[Violation]:
    """A user's advantage stage reads only columns written before it, and the reward as the
    reward stage wrote it (it is not handed the KL terms the built-in one subtracts)."""
    if not spec.advantage_stage:
        return []
    out = []
    graph = stages_for(cfg)
    k = next(i for i, s in enumerate(graph) if s.name == "advantage")
    written = set(data_columns(cfg)).union(*(s.outputs for s in graph[:k]))
    unknown = [c for c in spec.advantage_inputs if c not in written]
    if unknown:
        out.append(
            Violation(
                "algorithm.name",
                cfg.algorithm.name,
                f"its advantage stage reads {', '.join(unknown)}, which no stage before it writes in this config",
                f"read only columns written before it: {', '.join(sorted(written))}",
            )
        )
    if Modes.of(cfg).kl_in_reward:
        out.append(
            Violation(
                "algorithm.kl_coef",
                cfg.algorithm.kl_coef,
                f"{cfg.algorithm.name}'s advantage stage reads the reward as the reward stage wrote it, without the "
                "KL-in-reward term",
                "set algorithm.use_kl_loss: true (KL in the loss) or algorithm.kl_coef: 0",
            )
        )
    return out


def check_groups(cfg: Config, spec: AlgorithmSpec) -> list[Violation]:
    """A group-relative estimator needs N >= 2 distinct responses per prompt."""
    a, out = cfg.algorithm, []
    if spec.needs_group_of_two:
        if cfg.rollout.n < 2:
            out.append(
                Violation(
                    "rollout.n",
                    cfg.rollout.n,
                    f"{a.name} compares each response with the other responses to its prompt; N=1 has none",
                    "set rollout.n >= 2",
                )
            )
        if cfg.rollout.temperature == 0 and cfg.rollout.n > 1:
            out.append(
                Violation(
                    "rollout.temperature",
                    0.0,
                    "greedy sampling gives N identical responses and zero advantages",
                    "set a temperature > 0, e.g. 1.0",
                )
            )
    return out


def check_critic_fields(cfg: Config, spec: AlgorithmSpec) -> list[Violation]:
    """Critic fields only with a critic; a critic's own model folder must exist."""
    a, out = cfg.algorithm, []
    if not spec.critic:
        critic_only = {"lam", "value_clip", "critic_lr"} | (set() if spec.discounted else {"gamma"})
        for field in sorted(critic_only & a.model_fields_set):
            out.append(
                Violation(
                    f"algorithm.{field}",
                    getattr(a, field),
                    f"only PPO has a critic; algorithm.name is {a.name}",
                    "remove it or set algorithm.name: ppo",
                )
            )
        for field in sorted(cfg.critic.model_fields_set):
            out.append(
                Violation(
                    f"critic.{field}",
                    getattr(cfg.critic, field),
                    f"only PPO has a critic; algorithm.name is {a.name}",
                    "remove the critic section or set algorithm.name: ppo",
                )
            )
    elif cfg.critic.model_path is not None and not (Path(cfg.critic.model_path) / "config.json").is_file():
        out.append(
            Violation(
                "critic.model_path",
                cfg.critic.model_path,
                "no config.json in that folder",
                "point it at a local HF folder or leave it out (the actor's weights)",
            )
        )
    return out


def check_objective_terms(cfg: Config, spec: AlgorithmSpec) -> list[Violation]:
    """KL loss, DAPO's overlong buffer and dynamic sampling, Dr. GRPO's undivided advantages."""
    a, out = cfg.algorithm, []
    if "use_kl_loss" in a.model_fields_set and a.kl_coef == 0:
        out.append(
            Violation(
                "algorithm.use_kl_loss",
                a.use_kl_loss,
                "there is no KL term: algorithm.kl_coef is 0",
                "set kl_coef > 0 or remove use_kl_loss",
            )
        )
    if spec.dapo and a.overlong_buffer >= cfg.rollout.max_response_length:
        out.append(
            Violation(
                "algorithm.overlong_buffer",
                a.overlong_buffer,
                f"not shorter than rollout.max_response_length={cfg.rollout.max_response_length}",
                "use a buffer smaller than the response length",
            )
        )
    if a.dynamic_sampling and not spec.dapo:
        out.append(
            Violation(
                "algorithm.dynamic_sampling",
                True,
                f"dynamic sampling is DAPO's; algorithm.name is {a.name}",
                "set algorithm.name: dapo or dynamic_sampling: false",
            )
        )
    if not a.norm_adv_by_std and not spec.std_normalised:  # asks for Dr. GRPO's undivided advantages
        out.append(
            Violation(
                "algorithm.norm_adv_by_std",
                False,
                f"only GRPO and DAPO divide by the group std; algorithm.name is {a.name}",
                "remove it",
            )
        )
    return out


def check_correction(cfg: Config, spec: AlgorithmSpec) -> list[Violation]:
    """Rollout correction (TIS, IcePop, MIS bands) and DAPO's clip-higher."""
    out = []
    if cfg.actor.correction.icepop_band is not None and cfg.actor.correction.tis_cap is not None:
        out.append(
            Violation(
                "actor.correction.tis_cap",
                cfg.actor.correction.tis_cap,
                "IcePop's weight is already the importance ratio (inside its band); TIS would apply it twice",
                "remove actor.correction.tis_cap with actor.correction.icepop_band (or the band, to truncate "
                "instead of mask)",
            )
        )
    for field in ("icepop_band", "mis_band"):
        band = getattr(cfg.actor.correction, field)
        if band is not None and not band[0] < 1.0 < band[1]:
            out.append(
                Violation(
                    f"actor.correction.{field}",
                    list(band),
                    "the band must hold ratio 1 strictly inside ([low, high], low < 1 < high)",
                    "e.g. [0.5, 2.0]",
                )
            )
    if cfg.actor.loss.clip_ratio_high < cfg.actor.loss.clip_ratio_low and spec.dapo:
        out.append(
            Violation(
                "actor.loss.clip_ratio_high",
                cfg.actor.loss.clip_ratio_high,
                "DAPO's clip-higher needs clip_ratio_high >= clip_ratio_low",
                f"set it >= {cfg.actor.loss.clip_ratio_low}, e.g. 0.28",
            )
        )
    return out
