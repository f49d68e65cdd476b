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
        r = {
            "iteration": i,
            "reward_mean": i / n,
            "accuracy": i / n,
            "response_length_mean": 5.0 + i,
            "response_length_max": 8.0 + i,
            "kl": 0.01 * i,
            "entropy": 1 - i / n,
            "clip_frac": 0.1,
            "logprob_mismatch_mean": 1e-6,
            "logprob_mismatch_max": 1e-5,
            "grad_norm": math.exp(-i),
            "time_actor_rollout": 1.0,
            "time_actor_update": 0.5,
            "mem_actor_rollout_bytes": 2.0**30,
            "mem_actor_update_bytes": 2.0**29,
        }
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


def test_long_series_are_smoothed_and_the_warm_up_is_drawn_apart():
    """200 noisy iterations: the accuracy figure draws the raw series faint and, over it,
    TensorBoard's debiased EMA (checked against its closed form in float64); the stage-time
    figure puts the 27 s first iteration in a warm-up panel and scales the steady one to the
    0.7 s iterations (before, iteration 0 set the scale and the rest was a flat band)."""
    import random

    import matplotlib.pyplot as plt

    from spmd_rl.report.plots import SMOOTHING, figure, smoothed

    rng = random.Random(0)
    rows = [
        {
            "iteration": i,
            "accuracy": min(1.0, 0.25 + i / 400 + rng.gauss(0, 0.1)),
            "time_actor_rollout": 0.5 + rng.random() * 0.05,
            "time_actor_update": 0.2,
        }
        for i in range(200)
    ]
    rows[0]["time_actor_rollout"] = 27.0
    by_name = {f.name: f for f in FIGURES}
    acc = figure(by_name["accuracy"], rows)
    (ax,) = acc.axes
    raw, smooth = ax.get_lines()
    ys = [r["accuracy"] for r in rows]
    assert list(raw.get_ydata()) == ys and raw.get_alpha() < 1 and smooth.get_color() == raw.get_color()
    w = SMOOTHING
    closed = [(1 - w) * sum(w ** (t - k) * ys[k] for k in range(t + 1)) / (1 - w ** (t + 1)) for t in range(len(ys))]
    # float64: an EMA of 200 values in [0, 1] vs its closed form, eps 2.2e-16 x ~200 steps; measured 3.3e-16
    assert max(abs(a - b) for a, b in zip(smooth.get_ydata(), closed)) < 1e-12
    assert smoothed([3.0])[0] == 3.0  # debiased: the first point is the first value
    stage = figure(by_name["stage_time"], rows)
    warm, steady = stage.axes
    assert [t.get_text() for t in warm.get_xticklabels()] == ["0"]
    assert max(p.get_y() + p.get_height() for p in warm.patches) == 27.2
    assert steady.get_ylim()[1] < 1.5  # the steady iterations' own scale
    plt.close("all")
    short = figure(by_name["stage_time"], rows[1:5])
    assert len(short.axes) == 1  # no warm-up: one panel
    plt.close("all")
