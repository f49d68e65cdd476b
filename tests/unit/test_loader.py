from __future__ import annotations

import pytest

from spmd_rl.config.errors import ConfigError
from spmd_rl.config.loader import apply_overrides, parse_override, read_yaml


def test_override_values_are_typed():
    assert parse_override("actor.lr=1e-5") == (["actor", "lr"], 1e-5)
    assert parse_override("metadata.endpoints=[a:1, b:2]") == (["metadata", "endpoints"], ["a:1", "b:2"])
    assert parse_override("checkpoint.resume=null")[1] is None
    assert parse_override("logging.progress=false")[1] is False


def test_overrides_create_nested_sections_without_touching_input():
    tree = {"actor": {"lr": 1.0}}
    out = apply_overrides(tree, ["actor.lr=2", "parallel.train.tp=2"])
    assert out == {"actor": {"lr": 2}, "parallel": {"train": {"tp": 2}}}
    assert tree == {"actor": {"lr": 1.0}}


@pytest.mark.parametrize("bad", ["actor.lr", "=3", "actor..lr=3", "a.b=[unclosed"])
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
