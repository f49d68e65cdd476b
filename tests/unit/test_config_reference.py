"""docs/config.md is the schema's own rendering (``config.reference``): it fails when a field is
added, removed, re-described or re-ranged without regenerating the file, and every field of
the schema appears in it with its default."""

from __future__ import annotations

from typer.testing import CliRunner

from spmd_rl.cli import app
from spmd_rl.config.reference import render
from spmd_rl.config.schema import Config
from tests.conftest import REPO


def _leaves(model, prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            out += _leaves(sub, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def test_docs_config_is_up_to_date():
    doc = (REPO / "docs/config.md").read_text()
    assert doc == render(), "docs/config.md is out of date: run `spmd-rl config-reference > docs/config.md`"


def test_every_field_is_in_the_reference_with_its_range():
    text = render()
    leaves = _leaves(Config)
    assert len(leaves) > 100
    for leaf in leaves:
        assert f"| `{leaf}` |" in text, leaf
    assert "| `data.global_batch_size` | int | `required` | > 0 |" in text
    assert "| `actor.optim.betas` | tuple of float (>= 0.0, < 1.0), float (>= 0.0, < 1.0) | `[0.9, 0.999]` |" in text


def test_the_cli_prints_it():
    res = CliRunner().invoke(app, ["config-reference"])
    assert res.exit_code == 0 and res.output == render()
