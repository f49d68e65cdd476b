"""``logging.wandb`` through a real 2-rank run in W&B's offline mode: every iteration's row in
the run file holds every metric metrics.jsonl has, with the same values, and the logged config
leaves out the job token (``tests/helpers/wandb_records.py`` reads the file). ``spmd-rl report``
on the same finished run draws every figure of a run of this kind and shows its config."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from spmd_rl.cli import app
from spmd_rl.report.plots import FIGURES

from tests.helpers.wandb_records import config_text, history, run_name
from tests.trainer_util import train

TOKEN = "trainer-test-token-0123456789"  # tests.trainer_util's job token


@pytest.mark.slow
def test_wandb_offline_logs_the_jsonl_metrics(tiny_model, tmp_path, etcd):
    rows = train(tmp_path, "wb", etcd.endpoint, "logging.wandb.project=spmd-rl-test", "logging.wandb.mode=offline", "logging.wandb.name=tiny-run",
                 "checkpoint.interval=0", extra_env={"WANDB_SILENT": "true"})
    (run,) = (tmp_path / "wb/logs/wandb").glob("offline-run-*/run-*.wandb")
    logged = history(run)
    assert run_name(run) == "tiny-run"
    assert len(logged) == len(rows) == 2
    for want, got in zip(rows, logged):
        numeric = {k: v for k, v in want.items() if isinstance(v, (int, float))}
        assert set(numeric) <= set(got), set(numeric) - set(got)
        assert all(got[k] == pytest.approx(v) for k, v in numeric.items())
    config = config_text(run)
    assert "rollout=" in config and '"environment":null' in config  # the run's config, as validated
    assert TOKEN not in config
    res = CliRunner().invoke(app, ["report", str(tmp_path / "wb/logs")])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output.strip().splitlines()[-1])
    assert got["no_data"] == [] and len(got["figures"]) == len(FIGURES)
    page = (tmp_path / "wb/logs/report/report.html").read_text()
    assert "<td>rollout.n</td><td>4</td>" in page and TOKEN not in page
