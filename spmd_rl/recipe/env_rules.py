"""Rules of multi-turn rollouts (``rollout.environment``): what the environment needs from the
rest of the config, and the combinations this version refuses with the reason."""

from __future__ import annotations

from spmd_rl.catalog import findable
from spmd_rl.config.errors import Violation
from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import Config, RolloutConfig
from spmd_rl.recipe.graph import Modes

_TURN_FIELDS = ("max_turns", "tool_timeout_s", "unsafe_python_without_jail")


def check_environment(cfg: Config, gen: Layout) -> list[Violation]:
    """Turn fields set without an environment; else the environment's name and jail, and what
    tool turns need of the chat template, route replay and partial rollouts."""
    r, m = cfg.rollout, Modes.of(cfg)
    if not m.multi_turn:
        return [
            Violation(
                f"rollout.{f}",
                getattr(r, f),
                "only read with rollout.environment",
                "remove it or set rollout.environment",
            )
            for f in _TURN_FIELDS
            if f in r.model_fields_set
        ]
    out = _check_name(r.environment) + _check_jail(r)
    if not cfg.data.apply_chat_template:
        out.append(
            Violation(
                "data.apply_chat_template",
                False,
                "tool turns are rendered by the chat template, which starts from the prompt's user message",
                "set data.apply_chat_template: true",
            )
        )
    if m.records_routes:
        out.append(
            Violation(
                "actor.moe.router_replay",
                cfg.actor.moe.router_replay,
                "routes are recorded per request, and a trajectory is several requests",
                "set actor.moe.router_replay: none with rollout.environment",
            )
        )
    if gen.tp > 1 and cfg.stream.partial_tokens:
        out.append(
            Violation(
                "parallel.gen.tp",
                gen.tp,
                "under partial rollout each TP rank rebuilds the carried trajectories itself, and they must agree",
                "set parallel.gen.tp: 1 with rollout.environment and stream.partial_tokens (raise parallel.gen.dp "
                "instead)",
            )
        )
    return out


def _check_jail(r: RolloutConfig) -> list[Violation]:
    """The python environment runs model-written code in a jail, unless the user accepted the
    unsafe path; the unsafe switch means nothing for another environment."""
    out = []
    if r.environment == "python" and not r.unsafe_python_without_jail:
        from spmd_rl.envs.jail import jail_problem

        if (problem := jail_problem()) is not None:
            out.append(
                Violation(
                    "rollout.environment",
                    "python",
                    f"model-written code runs in a jail, and none can be had here: {problem}",
                    "install bubblewrap (launch/setup.sh does) where user namespaces are allowed, or accept what "
                    "rollout.unsafe_python_without_jail: true costs",
                )
            )
    elif r.unsafe_python_without_jail and r.environment != "python":
        out.append(
            Violation(
                "rollout.unsafe_python_without_jail", True, "only read with rollout.environment: python", "remove it"
            )
        )
    return out


def _check_name(name: str) -> list[Violation]:
    from spmd_rl.envs.factory import ENVIRONMENTS  # importing the factory registers the built-ins

    if ":" not in name:
        if name not in ENVIRONMENTS:
            return [
                Violation(
                    "rollout.environment",
                    name,
                    "not a registered environment",
                    f"use one of {', '.join(sorted(ENVIRONMENTS))} or my_pkg.envs:make",
                )
            ]
        return []
    if not findable(name):
        module, _, func = name.partition(":")
        return [
            Violation(
                "rollout.environment",
                name,
                f"module {module!r} not importable or {func!r} not a name",
                "put the module on PYTHONPATH and give module:function",
            )
        ]
    return []
