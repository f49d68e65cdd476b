"""What a checkpoint records of its run's config, and the config ``spmd-rl eval`` builds from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmd_rl.config.errors import ConfigError
from spmd_rl.config.loader import load_config
from spmd_rl.trainer.offline_eval import offline_config, recorded_config

REPO = Path(__file__).resolve().parents[2]


def test_a_checkpoints_config_leaves_out_the_dock_token_and_comes_back_with_the_options_applied(tmp_path):
    cfg = load_config(REPO / "configs/quickstart.yaml", ["dock.token=s3cret-token-0123456789", "eval.interval=3"])
    tree = recorded_config(cfg)
    assert tree["dock"]["token"] is None and "s3cret" not in str(tree)
    back = offline_config(None, tree, tmp_path / "hf", ["eval.n=8", "data.test_path=x.jsonl"])
    assert back.model.path == str(tmp_path / "hf") and back.eval.n == 8 and back.data.test_path == "x.jsonl"
    # everything else is the run's: its data fields, reward, eval section
    assert back.model_dump(exclude={"model", "eval", "data", "dock"}) == cfg.model_dump(
        exclude={"model", "eval", "data", "dock"}
    )
    assert back.eval.interval == 3 and back.data.prompt_column == cfg.data.prompt_column


def test_without_a_config_the_options_alone_make_one_and_bad_ones_name_the_field(tmp_path):
    cfg = offline_config(None, None, tmp_path, ["data.test_path=t.jsonl", "reward.rule=math_verify"])
    assert cfg.reward.rule == "math_verify" and cfg.rollout.max_response_length == 8 and cfg.eval.greedy
    with pytest.raises(ConfigError, match="eval.top_p"):
        offline_config(None, None, tmp_path, ["eval.top_p=2"])


def test_the_old_eval_fields_still_load_under_their_new_names():
    cfg = load_config(REPO / "configs/quickstart.yaml", ["trainer.eval_interval=4", "trainer.eval_limit=9"])
    assert (cfg.eval.interval, cfg.eval.limit) == (4, 9)
