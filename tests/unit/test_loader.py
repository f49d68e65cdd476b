from __future__ import annotations

import pytest

from spmd_rl.config.errors import ConfigError
from spmd_rl.config.loader import apply_overrides, parse_override, read_yaml


def test_override_values_are_typed():
    assert parse_override("actor.optim.lr=1e-5") == (["actor", "optim", "lr"], 1e-5)
    assert parse_override("metadata.endpoints=[a:1, b:2]") == (["metadata", "endpoints"], ["a:1", "b:2"])
    assert parse_override("checkpoint.resume=null")[1] is None
    assert parse_override("logging.progress=false")[1] is False


def test_overrides_create_nested_sections_without_touching_input():
    tree = {"actor": {"optim": {"lr": 1.0}}}
    out = apply_overrides(tree, ["actor.optim.lr=2", "parallel.train.tp=2"])
    assert out == {"actor": {"optim": {"lr": 2}}, "parallel": {"train": {"tp": 2}}}
    assert tree == {"actor": {"optim": {"lr": 1.0}}}


@pytest.mark.parametrize("bad", ["actor.optim.lr", "=3", "actor..lr=3", "a.b=[unclosed"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError) as err:
        apply_overrides({}, [bad])
    assert err.value.exit_code == 2


def test_invalid_yaml_names_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\n bad: [\n")
    with pytest.raises(ConfigError) as err:
        read_yaml(p)
    assert "line" in str(err.value)


def test_a_renamed_field_is_read_under_its_old_name_with_a_message_naming_the_new(tmp_path, caplog, in_repo):
    """0.2 moved actor's optimizer, loss, correction and MoE fields and vLLM's own settings into
    sections (``config.renamed``): a config file or override with the old names still loads,
    into the same values, and says what to rename; an override by the old name still wins over
    the file's new one; a file with both names is refused."""
    from spmd_rl.config.loader import load_config

    text = (in_repo / "configs/quickstart.yaml").read_text()
    old = text.replace("  optim:\n    lr: 1.0e-4\n", "  lr: 3.0e-4\n  optim:\n")
    assert old != text
    (tmp_path / "old.yaml").write_text(old.replace("  kv_cache_gib:", "  enforce_eager: false\n  kv_cache_gib:"))
    with caplog.at_level("WARNING", logger="spmd_rl"):
        cfg = load_config(tmp_path / "old.yaml", ["actor.tis_cap=2.0", "actor.moe_aux_loss_coef=0.5"])
    assert cfg.actor.optim.lr == 3.0e-4 and cfg.rollout.vllm.enforce_eager is False
    assert cfg.actor.correction.tis_cap == 2.0 and cfg.actor.moe.aux_loss_coef == 0.5
    said = caplog.text
    for old_name, new_name in [
        ("actor.lr", "actor.optim.lr"),
        ("rollout.enforce_eager", "rollout.vllm.enforce_eager"),
        ("actor.tis_cap", "actor.correction.tis_cap"),
        ("actor.moe_aux_loss_coef", "actor.moe.aux_loss_coef"),
    ]:
        assert f"{old_name} is now {new_name}" in said, said
    assert load_config(in_repo / "configs/quickstart.yaml", ["actor.lr=5e-5"]).actor.optim.lr == 5e-5
    (tmp_path / "both.yaml").write_text(text.replace("  optim:\n", "  lr: 3.0e-4\n  optim:\n"))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "both.yaml")
    assert "actor.lr" in str(err.value) and "also as actor.optim.lr" in str(err.value)
