"""The multi-turn fields through ``spmd-rl validate``: what runs is valid, and each combination
this version refuses exits 2 naming the field and the fix (``config/env_rules.py``)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from spmd_rl.cli import app

TOOLS = "configs/quickstart_tools.yaml"


def validate(config: str, *overrides: str):
    return CliRunner().invoke(app, ["validate", config, *overrides])


@pytest.mark.parametrize("extra", [(), ("rollout.environment=python",), ("rollout.environment=tests.helpers.envs:echo",),
                                   ("algorithm.name=dapo", "algorithm.dynamic_sampling=true"), ("stream.fuse=true",),
                                   ("parallel.placement=separated", "parallel.gen_ranks=1", "parallel.gen.dp=1", "parallel.train.dp_shard=1",
                                    "actor.tis_cap=2.0"), ("stream.partial_tokens=4", "actor.tis_cap=2.0"),
                                   ("parallel.gen.tp=2", "parallel.gen.dp=1"), ("algorithm.name=ppo", "algorithm.critic_lr=1e-4")],
                         ids=["calculator", "python", "module-function", "dapo", "fused", "separated", "partial", "gen-tp2", "ppo"])
def test_what_multi_turn_runs_is_valid(in_repo, tiny_tools, extra):
    res = validate(TOOLS, *extra)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("overrides,field", [
    (("rollout.environment=abacus",), "rollout.environment"),
    (("rollout.environment=no_such_module:make",), "rollout.environment"),
    (("data.apply_chat_template=false",), "data.apply_chat_template"),
    (("parallel.gen.tp=2", "parallel.gen.dp=1", "stream.partial_tokens=4", "actor.tis_cap=2.0"), "parallel.gen.tp"),
], ids=["unknown-name", "unknown-module", "no-chat-template", "gen-tp-partial"])
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
    res = validate("configs/quickstart_moe.yaml", "rollout.environment=calculator", "actor.router_replay=record")
    assert res.exit_code == 2 and "actor.router_replay" in res.output, res.output
