"""``spmd-rl eval`` with a run's config, as a user runs it in a new terminal (no preload server):
the config's data fields, reward and ``eval`` section apply, sampled scores come with pass@k,
and the terminal holds the one JSON line and nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spmd_rl.launcher import preload
from tests.conftest import subprocess_env

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 12


@pytest.mark.slow
def test_eval_applies_the_runs_config_in_a_quiet_terminal(tiny_model, tmp_path):
    rows = [json.loads(line) for line in (tiny_model / "test.jsonl").read_text().splitlines()][:PROMPTS]
    nested = tmp_path / "nested.jsonl"  # verl's layout: messages, a nested answer, a data source
    nested.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": r["prompt"]}],
                    "reward_model": {"ground_truth": r["answer"]},
                    "data_source": "arith",
                }
            )
            + "\n"
            for r in rows
        )
    )
    cfg = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    cfg["data"] |= {"test_path": {"held": str(nested)}, "answer_column": "reward_model.ground_truth"}
    cfg["eval"] = {"n": 4, "temperature": 1.0, "max_tokens": 8}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in subprocess_env().items() if k not in (preload.ENV, "TORCH_CPP_LOG_LEVEL")}
    res = subprocess.run(
        [sys.executable, "-m", "spmd_rl.cli", "eval", str(tiny_model), "--config", str(tmp_path / "run.yaml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr == "", res.stderr  # vLLM's, torch's and the C++ start-up notes stay off the terminal
    (line,) = res.stdout.splitlines()
    got = json.loads(line)
    # the nested answer was read (a broken reader would score 0 or refuse the rows): the tiny
    # model answers some of these greedily (test_tiny_model: 10-50 %)
    assert got["prompts"] == got["eval/held/prompts"] == PROMPTS and got["correct"] >= 1
    assert got["accuracy"] == got["eval/held/greedy"] == got["correct"] / PROMPTS
    assert {"eval/held/mean@4", "eval/held/pass@2", "eval/held/pass@4", "eval/held/maj@4"} <= set(got)
    # pass@1's estimator is c/n per prompt, mean@n's too: equal to float64 rounding of a 12-term mean
    assert got["eval/held/pass@1"] == pytest.approx(got["eval/held/mean@4"], abs=1e-12)
    assert got["eval/held/pass@1"] <= got["eval/held/pass@2"] <= got["eval/held/pass@4"]


@pytest.mark.slow
def test_eval_refuses_what_it_cannot_evaluate(tiny_model, tmp_path):
    base = [sys.executable, "-m", "spmd_rl.cli", "eval", str(tiny_model)]
    for extra, says in (
        ([], "nothing to evaluate"),
        (["--data", str(tmp_path / "none.jsonl")], "file not found"),
        (["--data", str(tiny_model / "test.jsonl"), "eval.n=-1"], "eval.n"),
    ):
        res = subprocess.run(base + extra, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 2 and says in res.stderr, (extra, res.stderr[-2000:])


@pytest.mark.slow
def test_eval_with_tp_2_scores_what_tp_1_scores(tiny_model):
    """``--tp 2``: vLLM's own two CPU workers, each bound to its share of the cores (vLLM refuses
    more workers than NUMA nodes unless told where to bind), give the greedy answers of one
    engine; more TP workers than cores is a user error."""
    runs = {}
    for tp in (1, 2, 64):
        cmd = [sys.executable, "-m", "spmd_rl.cli", "eval", str(tiny_model), "--data", str(tiny_model / "test.jsonl")]
        cmd += ["--limit", str(PROMPTS), "--tp", str(tp)]
        env = {k: v for k, v in subprocess_env().items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
        runs[tp] = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert runs[1].returncode == runs[2].returncode == 0, runs[2].stderr[-3000:]
    one, two = (json.loads(runs[tp].stdout.splitlines()[-1]) for tp in (1, 2))
    # float32 with the projections split over 2 workers: a greedy near-tie may flip, one of 12 at most
    assert abs(one["correct"] - two["correct"]) <= 1 and two["prompts"] == PROMPTS, (one, two)
    assert runs[64].returncode == 2 and "--tp 64" in runs[64].stderr, runs[64].stderr[-2000:]
