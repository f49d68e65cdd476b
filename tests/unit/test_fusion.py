"""Stage fusion's logic (``recipe.graph.fused_stages``, ``trainer.fusion``): which stages may
run during generation for each algorithm, how big a streamed wave is, how wave results merge,
and the config rule that refuses a fusion with nothing to fuse. The end-to-end invariant (the
same weights bit for bit with and without fusion) is in test_trainer_torchrun."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spmd_rl.config.loader import load_config
from spmd_rl.recipe.rules import check
from spmd_rl.recipe.graph import fused_stages, stages_for
from spmd_rl.trainer.fusion import _waves_per_group, merge
from spmd_rl.trainer.stages import StageResult
from tests.conftest import REPO

FUSE = ["stream.fuse=true"]


@pytest.mark.parametrize(
    "overrides, fused",
    [
        ([], ["reward", "advantage"]),
        (["algorithm.kl_coef=0.1"], ["reward", "advantage"]),  # the KL loss needs ref_logprob, the advantage does not
        (
            ["algorithm.kl_coef=0.1", "algorithm.use_kl_loss=false"],
            ["reward"],
        ),  # KL in the reward: advantage needs ref/old log-probs
        (["algorithm.name=dapo", "algorithm.dynamic_sampling=true"], ["reward"]),  # groups are picked after the rounds
        (["algorithm.name=ppo"], ["reward"]),  # GAE needs the critic's values
        # whitening over every token of the batch: a wave's moments are not the batch's
        (["algorithm.name=reinforce_pp"], ["reward"]),
        (["algorithm.name=reinforce_pp_baseline"], ["reward"]),
        (["algorithm.name=rloo"], ["reward", "advantage"]),  # per group: a wave holds whole groups
        (["reward.kind=model", "reward.model_path=assets/tiny-qwen2/reward_model"], []),
    ],
)
def test_fused_stages_per_algorithm(overrides, fused):
    cfg = load_config(REPO / "configs/quickstart.yaml", FUSE + overrides)
    graph = stages_for(cfg)
    got = fused_stages(cfg, graph)
    assert [s.name for s in got] == fused
    assert all(not s.roles for s in got)
    assert fused_stages(load_config(REPO / "configs/quickstart.yaml", overrides), graph) == []  # off by default


def test_fuse_with_nothing_to_fuse_is_refused(in_repo):
    cfg = load_config(
        REPO / "configs/quickstart.yaml",
        FUSE + ["reward.kind=model", "reward.model_path=assets/tiny-qwen2/reward_model"],
    )
    _, errors = check(cfg, world=2)
    assert [e.field for e in errors] == ["stream.fuse"] and "reward.kind: rule" in errors[0].fix


def test_wave_size_follows_micro_batch_size():
    for micro, n, samples, groups in ((8, 4, 8, 2), (5, 4, 5, 2), (2, 8, 2, 1), (16, 8, 16, 2)):
        cfg = load_config(
            REPO / "configs/quickstart.yaml", FUSE + [f"stream.micro_batch_size={micro}", f"rollout.n={n}"]
        )
        run = SimpleNamespace(cfg=cfg)
        reward, advantage = fused_stages(cfg, stages_for(cfg))
        assert _waves_per_group(run, reward) == samples  # samples per DP group
        assert _waves_per_group(run, advantage) == groups  # whole prompt groups per DP group


def test_merge_adds_sums_and_rewards_and_maxes_maxima():
    a = StageResult(
        sums={"reward_sum": 1.5, "generated": 2},
        maxes={"len": 3},
        rewards=torch.tensor([1.0, 0, 0, 0], dtype=torch.float64),
    )
    b = StageResult(
        sums={"reward_sum": 0.5, "generated": 2},
        maxes={"len": 7},
        rewards=torch.tensor([0, 0, 2.0, 0], dtype=torch.float64),
    )
    m = merge([a, b, StageResult()])
    assert m.sums == {"reward_sum": 2.0, "generated": 4} and m.maxes == {"len": 7}
    assert m.rewards.tolist() == [1.0, 0, 2.0, 0] and a.rewards.tolist() == [1.0, 0, 0, 0]
