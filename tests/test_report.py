"""``spmd-rl report`` on a metrics file: every figure whose metrics are there is a PNG, the page
inlines them with the config, a metric the run did not log leaves the others drawn and is
listed, a line cut by a kill is skipped, and a folder without metrics exits 2. (On a real
finished run: ``test_run_outputs_torchrun.py``.)"""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from spmd_rl.cli import app
from spmd_rl.report.plots import FIGURES

PNG = b"\x89PNG\r\n\x1a\n"


def _rows(n: int, drop: tuple[str, ...] = ()) -> list[dict]:
    rows = []
    for i in range(n):
        r = {"iteration": i, "reward_mean": i / n, "accuracy": i / n, "response_length_mean": 5.0 + i, "response_length_max": 8.0 + i,
             "kl": 0.01 * i, "entropy": 1 - i / n, "clip_frac": 0.1, "logprob_mismatch_mean": 1e-6, "logprob_mismatch_max": 1e-5,
             "grad_norm": math.exp(-i), "time_actor_rollout": 1.0, "time_actor_update": 0.5, "mem_actor_rollout_bytes": 2.0**30,
             "mem_actor_update_bytes": 2.0**29}
        if i % 2 == 0:
            r["eval_accuracy"] = 0.3
        rows.append({k: v for k, v in r.items() if k not in drop})
    return rows


def _write(folder, rows, config=True, torn=False):
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + ('{"iteration": 9, "rew' if torn else "")
    (folder / "metrics.jsonl").write_text(text)
    if config:
        (folder / "config.json").write_text(json.dumps({"algorithm": {"name": "grpo"}, "rollout": {"n": 8}}))


def test_every_figure_and_the_page(tmp_path):
    _write(tmp_path / "logs", _rows(6), torn=True)
    res = CliRunner().invoke(app, ["report", str(tmp_path / "logs")])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output.strip().splitlines()[-1])
    assert got["no_data"] == [] and len(got["figures"]) == len(FIGURES)
    for f in got["figures"]:
        assert open(f, "rb").read(8) == PNG
    page = (tmp_path / "logs/report/report.html").read_text()
    assert page.count("src='data:image/png;base64,") == len(FIGURES)
    assert "<td>algorithm.name</td><td>&quot;grpo&quot;</td>" in page and "6 iterations logged" in page


def test_a_missing_metric_leaves_the_others_drawn(tmp_path):
    _write(tmp_path / "logs", _rows(4, drop=("kl",)), config=False)
    res = CliRunner().invoke(app, ["report", str(tmp_path / "logs"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output.strip().splitlines()[-1])
    assert got["no_data"] == ["kl"] and len(got["figures"]) == len(FIGURES) - 1
    page = (tmp_path / "out/report.html").read_text()
    assert "No data for: KL to the reference" in page and "No config.json" in page


def test_a_folder_without_metrics_exits_2(tmp_path):
    res = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2 and "no metrics.jsonl" in res.output
