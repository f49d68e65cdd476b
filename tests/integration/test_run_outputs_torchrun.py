"""What a finished run leaves in its logging folder, from one real 2-rank quickstart run (etcd,
vLLM) with ``logging.wandb`` in W&B's offline mode:

- the W&B run file (read back by ``tests/helpers/wandb_records.py``): every iteration's row
  holds every metric metrics.jsonl has, with the same values; the run name is the configured
  one; the logged config leaves out the job token;
- ``spmd-rl report`` draws every figure of a run of this kind and shows its config;
- ``spmd-rl report --trace``: a Chrome / Perfetto trace with one track per rank, whose named
  stage spans cover at least 95 % of every iteration's wall time on every rank, and whose
  parts (memory moves, dock waits, generation, forward/backward, optimizer) lie inside them.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from spmd_rl.cli import app
from spmd_rl.report.plots import FIGURES
from tests.helpers.wandb_records import config_text, history, run_name
from tests.trainer_util import train

TOKEN = "outputs-test-token-given-as-an-override-0123"
"""Given as ``dock.token=`` (so in the config and the program's arguments), where the checks
below can see it leak; the environment's token of tests.trainer_util is overridden by it."""
ITERS = 3


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory, etcd):
    tmp = tmp_path_factory.mktemp("outputs")
    rows = train(
        tmp,
        "q",
        etcd.endpoint,
        f"trainer.iterations={ITERS}",
        "logging.wandb.project=spmd-rl-test",
        "logging.wandb.mode=offline",
        "logging.wandb.name=tiny-run",
        "checkpoint.interval=0",
        f"dock.token={TOKEN}",
        extra_env={"WANDB_SILENT": "true"},
    )
    res = CliRunner().invoke(app, ["report", str(tmp / "q/logs"), "--trace"])
    assert res.exit_code == 0, res.output
    return tmp / "q/logs", rows, json.loads(res.output.strip().splitlines()[-1])


@pytest.mark.slow
def test_wandb_offline_logs_the_jsonl_metrics(run):
    logs, rows, _ = run
    (path,) = logs.glob("wandb/offline-run-*/run-*.wandb")
    logged = history(path)
    assert run_name(path) == "tiny-run"
    assert len(logged) == len(rows) == ITERS
    for want, got in zip(rows, logged):
        numeric = {k: v for k, v in want.items() if isinstance(v, (int, float))}
        assert set(numeric) <= set(got), set(numeric) - set(got)
        # the same numbers through wandb's offline file (float64; float32 at worst, 6e-8) vs approx's rel 1e-6
        assert all(got[k] == pytest.approx(v) for k, v in numeric.items())
    config = config_text(path)
    assert "rollout=" in config and '"environment":null' in config  # the run's config, as validated
    assert TOKEN not in config
    # nowhere in what the run wrote: W&B's run file and its metadata (the program's arguments),
    # the metrics, the config, the trace, vLLM's logs
    leaked = [p for p in logs.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert leaked == [], leaked


@pytest.mark.slow
def test_report_draws_every_figure_with_the_config(run):
    logs, _, made = run
    assert made["no_data"] == [] and len(made["figures"]) == len(FIGURES)
    page = (logs / "report/report.html").read_text()
    assert "<td>rollout.n</td><td>4</td>" in page and TOKEN not in page


@pytest.mark.slow
def test_the_trace_covers_every_iteration_on_every_rank(run):
    _, _, made = run
    trace = json.loads(open(made["trace"]).read())
    events = trace["traceEvents"]
    for e in events:  # the Trace Event Format's fields for the two phases used
        assert (
            isinstance(e["name"], str)
            and e["ph"] in ("X", "M")
            and isinstance(e["pid"], int)
            and isinstance(e["tid"], int)
        ), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0 and e["ts"] >= 0, e
        else:
            assert isinstance(e["args"], dict), e
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == {0: "rank 0", 1: "rank 1"}
    for rank in tracks:
        mine = [e for e in events if e["ph"] == "X" and e["tid"] == rank]
        iterations = [e for e in mine if e["cat"] == "iteration"]
        assert [e["name"] for e in iterations] == [f"iteration {i}" for i in range(ITERS)]
        for it in iterations:
            lo, hi = it["ts"], it["ts"] + it["dur"]
            stages = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] == "stage" and lo <= e["ts"] < hi)
            covered, edge = 0, lo
            for s, t in stages:
                covered += max(0, t - max(s, edge))
                edge = max(edge, t)
            assert covered >= 0.95 * it["dur"], (rank, it["name"], covered / it["dur"])
        parts = [e for e in mine if e["cat"] == "part"]
        assert {"residency", "dock_get", "dock_put", "generate", "forward_backward", "optimizer"} <= {
            e["name"] for e in parts
        }
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] == "stage"]
        assert all(any(s <= p["ts"] and p["ts"] + p["dur"] <= t for s, t in spans) for p in parts)
