"""The declared stage graph is the one that runs: every column a stage (or the data loader,
prompts with their answers) writes is read by a later stage (nothing is written for nobody), every input of a stage is
written before it, every stage has a registered function and declares known roles, and GRPO's advantage is one
scalar per sample while PPO's is per token."""

from __future__ import annotations

import pytest

from spmd_rl.config.loader import load_config
from spmd_rl.recipe.graph import COLUMNS, DATA_COLUMNS, ROLES, advantage_column, data_columns, stages_for
from spmd_rl.trainer.stages import REGISTRY
from tests.conftest import REPO

CONFIGS = {
    "grpo": [],
    "grpo-kl-offpolicy": ["algorithm.kl_coef=0.1", "actor.ppo_epochs=2"],
    "dapo": ["algorithm.name=dapo", "algorithm.dynamic_sampling=true"],
    "ppo": ["algorithm.name=ppo"],
    "ppo-kl-in-reward": ["algorithm.name=ppo", "algorithm.kl_coef=0.1", "algorithm.use_kl_loss=false"],
    "grpo-kl-in-reward": ["algorithm.kl_coef=0.1", "algorithm.use_kl_loss=false"],
    "reward-model": ["reward.kind=model", "reward.model_path=assets/tiny-qwen2/reward_model"],
    "partial-rollout": ["stream.partial_tokens=4", "actor.correction.tis_cap=2.0"],
}


@pytest.mark.parametrize("name", CONFIGS)
def test_every_column_written_is_read_and_every_input_written_first(name):
    cfg = load_config(REPO / "configs/quickstart.yaml", CONFIGS[name])
    graph = stages_for(cfg)
    written = set(data_columns(cfg))
    data_read = {c for s in graph for c in s.inputs}
    assert set(DATA_COLUMNS) <= data_read, f"the data loader writes {set(DATA_COLUMNS) - data_read} that nobody reads"
    for k, stage in enumerate(graph):
        assert set(stage.inputs) <= written, f"{stage.name} reads {set(stage.inputs) - written} before anyone writes it"
        later = {c for s in graph[k + 1 :] for c in s.inputs}
        unread = set(stage.outputs) - later
        assert not unread, f"{stage.name} writes {unread} that no later stage reads"
        written |= set(stage.outputs)
        assert stage.name in REGISTRY, f"no module registers stage {stage.name}"
        assert set(stage.roles) <= set(ROLES)


def test_advantage_column_kind_follows_the_algorithm():
    grpo = load_config(REPO / "configs/quickstart.yaml", [])
    ppo = load_config(REPO / "configs/quickstart.yaml", ["algorithm.name=ppo"])
    assert COLUMNS[advantage_column(grpo)] == "scalar" and COLUMNS[advantage_column(ppo)] == "response"


def test_stage_registry_refuses_unknown_and_duplicate_names():
    from spmd_rl.trainer.stages import register, stage_fn

    with pytest.raises(ValueError, match="unknown stage 'nope'.*add a module under trainer/stages/"):
        stage_fn("nope")
    with pytest.raises(ValueError, match="stage 'reward' registered twice"):
        register("reward")(lambda call: None)


MODES = {  # config: the modes that are on (every other bool off), generation rounds
    "grpo": (set(), 1),
    "grpo-kl-offpolicy": ({"needs_reference", "off_policy", "needs_old_log_prob"}, 1),
    "dapo": ({"dynamic_sampling"}, 1 + 2),  # algorithm.max_extra_rounds defaults to 2
    "ppo": (set(), 1),
    "ppo-kl-in-reward": ({"needs_reference", "kl_in_reward", "needs_old_log_prob"}, 1),
    "partial-rollout": ({"partial_rollout", "versioned"}, 1),
    "separated": (
        {"separated", "versioned"},
        1,
        ["parallel.placement=separated", "parallel.gen_ranks=1", "parallel.gen.dp=1", "parallel.train.dp_shard=1"],
    ),
    "routes": ({"records_routes"}, 1, ["actor.moe.router_replay=record"]),
    "multi-turn": ({"multi_turn"}, 1, ["rollout.environment=calculator"]),
    "dpo": ({"needs_reference"}, 1, ["algorithm.name=dpo"]),
}
"""Written by hand from the fields' documentation, not from ``Modes.of``; quickstart's mini-batch
is its global batch and it has one epoch, so GRPO alone is on-policy."""


@pytest.mark.parametrize("name", MODES)
def test_modes_are_what_each_config_is(name):
    from dataclasses import fields

    from spmd_rl.recipe.graph import Modes

    on, rounds, *extra = MODES[name]
    cfg = load_config(REPO / "configs/quickstart.yaml", CONFIGS.get(name, extra[0] if extra else []))
    m = Modes.of(cfg)
    flags = [f.name for f in fields(Modes) if f.type == "bool"] + ["versioned", "needs_old_log_prob"]
    assert {f for f in flags if getattr(m, f)} == on
    assert m.generation_rounds == rounds and m.algorithm.name == cfg.algorithm.name


def test_no_module_derives_a_mode_from_its_fields_but_the_graph():
    """A mode is derived once (``recipe.graph.Modes.of``); a second derivation elsewhere is how a
    rule written for one algorithm missed another."""
    import re

    raw = re.compile(
        r'placement (==|!=) "separated"|partial_tokens > 0|router_replay != "none"|\.environment is (not )?None'
        r"|\.dapo and [a-z_.]*dynamic_sampling"
    )
    found = [
        f"{p.relative_to(REPO)}:{k}"
        for p in (REPO / "spmd_rl").rglob("*.py")
        if p.name != "graph.py"
        for k, line in enumerate(p.read_text().splitlines(), 1)
        if raw.search(line)
    ]
    assert not found, f"derive these from recipe.graph.Modes: {found}"
