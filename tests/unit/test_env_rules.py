"""The multi-turn fields through ``spmd-rl validate``: what runs is valid, and each combination
this version refuses exits 2 naming the field and the fix (``recipe/env_rules.py``)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from spmd_rl.cli import app

TOOLS = "configs/quickstart_tools.yaml"


def validate(config: str, *overrides: str):
    return CliRunner().invoke(app, ["validate", config, *overrides])


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("rollout.environment=python",),
        ("rollout.environment=tests.helpers.envs:echo",),
        ("algorithm.name=dapo", "algorithm.dynamic_sampling=true"),
        ("stream.fuse=true",),
        (
            "parallel.placement=separated",
            "parallel.gen_ranks=1",
            "parallel.gen.dp=1",
            "parallel.train.dp_shard=1",
            "actor.correction.tis_cap=2.0",
        ),
        ("stream.partial_tokens=4", "actor.correction.tis_cap=2.0"),
        ("parallel.gen.tp=2", "parallel.gen.dp=1"),
        ("algorithm.name=ppo", "algorithm.critic_lr=1e-4"),
    ],
    ids=["calculator", "python", "module-function", "dapo", "fused", "separated", "partial", "gen-tp2", "ppo"],
)
def test_what_multi_turn_runs_is_valid(in_repo, tiny_tools, extra):
    res = validate(TOOLS, *extra)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    "overrides,field",
    [
        (("rollout.environment=abacus",), "rollout.environment"),
        (("rollout.environment=no_such_module:make",), "rollout.environment"),
        (("data.apply_chat_template=false",), "data.apply_chat_template"),
        (
            ("parallel.gen.tp=2", "parallel.gen.dp=1", "stream.partial_tokens=4", "actor.correction.tis_cap=2.0"),
            "parallel.gen.tp",
        ),
    ],
    ids=["unknown-name", "unknown-module", "no-chat-template", "gen-tp-partial"],
)
def test_what_multi_turn_does_not_run_exits_2_naming_the_field(in_repo, tiny_tools, overrides, field):
    res = validate(TOOLS, *overrides)
    assert res.exit_code == 2, res.output
    assert field in res.output and "->" in res.output, res.output


@pytest.mark.parametrize("field", ["rollout.max_turns=3", "rollout.tool_timeout_s=2"])
def test_turn_fields_without_an_environment_are_refused(in_repo, tiny_model, field):
    res = validate("configs/quickstart.yaml", field)
    assert res.exit_code == 2 and field.split("=")[0] in res.output and "rollout.environment" in res.output, res.output


def test_routing_replay_with_an_environment_is_refused(in_repo, tiny_moe, tiny_tools):
    res = validate("configs/quickstart_moe.yaml", "rollout.environment=calculator", "rollout.max_response_length=32")
    assert res.exit_code == 0, res.output
    res = validate("configs/quickstart_moe.yaml", "rollout.environment=calculator", "actor.moe.router_replay=record")
    assert res.exit_code == 2 and "actor.moe.router_replay" in res.output, res.output


def test_the_python_environment_without_a_jail_is_refused_unless_its_cost_is_accepted(in_repo, tiny_tools, monkeypatch):
    """Where bubblewrap cannot make a jail (here: made to say so), validate refuses
    ``rollout.environment: python`` naming the fix; ``rollout.unsafe_python_without_jail`` accepts
    the cost, and the field is refused where nothing reads it."""
    from spmd_rl.envs import jail

    monkeypatch.setattr(jail, "jail_problem", lambda: "bubblewrap (bwrap) is not installed")
    res = validate(TOOLS, "rollout.environment=python")
    assert res.exit_code == 2 and "rollout.environment" in res.output and "bubblewrap" in res.output, res.output
    assert "unsafe_python_without_jail" in res.output  # the fix names the opt-out
    assert validate(TOOLS, "rollout.environment=python", "rollout.unsafe_python_without_jail=true").exit_code == 0
    res = validate(TOOLS, "rollout.unsafe_python_without_jail=true")  # the calculator reads no such field
    assert res.exit_code == 2 and "rollout.unsafe_python_without_jail" in res.output, res.output


def test_the_python_environment_runs_its_code_in_the_jail_unless_told_otherwise():
    from spmd_rl.envs.base import Turn
    from spmd_rl.envs.factory import environment_factory

    turn = Turn("```python\nprint(6 * 7)\n```", ())
    jailed = environment_factory("python")({}).step(turn)
    assert jailed.observation == "42\n", jailed
    assert environment_factory("python")({}).limits.jail and not environment_factory("python", True)({}).limits.jail
