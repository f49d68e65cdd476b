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
    "partial-rollout": ["stream.partial_tokens=4", "actor.tis_cap=2.0"],
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
