"""Rules of multi-turn rollouts (``rollout.environment``): what the environment needs from the
rest of the config, and the combinations this version refuses with the reason."""

from __future__ import annotations

from spmd_rl.catalog import findable, is_command_line
from spmd_rl.config.errors import Violation
from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import Config, RolloutConfig
from spmd_rl.recipe.graph import Modes

_TURN_FIELDS = ("max_turns", "tool_timeout_s", "unsafe_python_without_jail")


def check_environment(cfg: Config, gen: Layout) -> list[Violation]:
    """Turn fields set without an environment; else the environment's name and jail, and what
    tool turns need of the chat template, route replay and partial rollouts."""
    r, m = cfg.rollout, Modes.of(cfg)
    if m.agent:
        return check_agent(cfg, gen)
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
    out = _unread_gateway(r) + _check_name(r.environment) + _check_jail(r)
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


_GATEWAY_FIELDS = ("host", "port", "concurrency", "agent_timeout_s", "tool_parser", "max_request_kib", "max_messages")


def _unread_gateway(r: RolloutConfig) -> list[Violation]:
    return [
        Violation(f"rollout.gateway.{f}", getattr(r.gateway, f), "only read with rollout.agent", "remove it")
        for f in _GATEWAY_FIELDS
        if f in r.gateway.model_fields_set
    ]


def check_agent(cfg: Config, gen: Layout) -> list[Violation]:
    """``rollout.agent``: a findable function or a command, and what this version refuses beside
    it, with the reason (``gateway``)."""
    r, m, out = cfg.rollout, Modes.of(cfg), []
    if not is_command_line(r.agent) and not findable(r.agent):
        module, _, func = r.agent.partition(":")
        out.append(
            Violation(
                "rollout.agent",
                r.agent,
                f"module {module!r} not importable or {func!r} not a name (and not a command line)",
                "put the module on PYTHONPATH and give module:function, or a command such as 'python my_agent.py'",
            )
        )
    refused = [
        ("rollout.environment", r.environment, bool(r.environment), "the agent is the environment", "remove one"),
        (
            "stream.partial_tokens",
            cfg.stream.partial_tokens,
            m.partial_rollout,
            "a running agent cannot be carried to the next iteration yet",
            "set stream.partial_tokens: 0 with rollout.agent",
        ),
        (
            "parallel.gen.tp",
            gen.tp,
            gen.tp > 1,
            "the gateway serves one engine per rank, and TP ranks must submit the same requests together",
            "set parallel.gen.tp: 1 with rollout.agent (raise parallel.gen.dp instead)",
        ),
        (
            "reward.kind",
            cfg.reward.kind,
            cfg.reward.kind == "model",
            "a reward model scores the data loader's prompt, and an agent's samples carry their own",
            "use a rule, or return the reward from the agent",
        ),
        (
            "actor.moe.router_replay",
            cfg.actor.moe.router_replay,
            m.records_routes,
            "routes are recorded per request, and a trajectory is several requests",
            "set actor.moe.router_replay: none with rollout.agent",
        ),
    ]
    out += [Violation(f, v, why, fix) for f, v, bad, why, fix in refused if bad]
    out += [
        Violation(f"rollout.{f}", getattr(r, f), "only read with rollout.environment", "remove it")
        for f in _TURN_FIELDS
        if f in r.model_fields_set
    ]
    return out
