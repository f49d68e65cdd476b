"""The issue-12 benchmark tools build what they claim: the bench model's tokenizer decodes
every id the model can sample and its prompts are exactly 16 tokens; the floor's training step
runs the engines' log-prob path on a real HF model (warm-up plus one timed step); the weight
stream benchmark's two receivers both write the sent tensors bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))


def test_bench_model_decodes_every_id_and_has_16_token_prompts(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    import make_bench_model

    make_bench_model.build(tmp_path, vocab=300, positions=64, prompts=8, seed=0)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert len(tok) == cfg.vocab_size == 300 and cfg.max_position_embeddings == 64
    assert all(isinstance(tok.decode([i]), str) for i in range(300))
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(len(tok(r["prompt"], add_special_tokens=False).input_ids) == 16 for r in rows)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [tok.eos_token_id]


def test_long_tail_variant_stops_on_more_tokens(tmp_path):
    import make_bench_model

    make_bench_model.build(tmp_path, vocab=300, positions=64, prompts=8, seed=0, stop_tokens=5)
    stops = json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"]
    assert len(set(stops)) == 6 and all(0 <= t < 300 for t in stops)


def test_floor_training_step_runs_and_updates(tiny_model):
    from spmd_rl.config.loader import load_config

    import engine_floor

    cfg = load_config(
        REPO / "configs/quickstart.yaml", [f"model.path={tiny_model}", "rollout.n=2", "actor.optim.lr=1e-2"]
    )
    prompts = [[5, 6, 7], [8, 9]]
    responses = [[11, 12], [13], [14, 15, 16], [17]]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seconds = engine_floor.training(cfg, prompts, responses, pad_id=0, repeats=1, model=model)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert seconds > 0 and all(p.isfinite().all() for p in model.parameters())
    assert "lm_head.weight" in moved or "model.embed_tokens.weight" in moved  # the step updated the weights
    assert len(moved) >= len(before) // 2, moved


def test_weight_stream_bench_writes_the_sent_tensors_in_both_modes():
    from tests.conftest import subprocess_env

    out = subprocess.run(
        [sys.executable, str(REPO / "tools/bench_weight_stream.py"), "--params-m", "0.064", "--bucket-mib", "0.01"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stream / whole peak" in out.stdout and "both files hold the sent tensors bit for bit" in out.stdout, (
        out.stdout
    )


@pytest.mark.slow
def test_floor_flat_generation_has_the_same_tokens_and_no_tail(tiny_model):
    """``engine_floor --flat``: the no-tail run gives every sample the sampled run's mean
    length, and the streaming bound is (generation + training) / (flat generation + training)."""
    from tests.conftest import subprocess_env

    cmd = [
        sys.executable,
        str(REPO / "tools/engine_floor.py"),
        "configs/quickstart.yaml",
        f"model.path={tiny_model}",
        "data.global_batch_size=4",
        "actor.mini_batch_size=4",
        "rollout.n=2",
        "rollout.max_response_length=16",
        "--flat",
        "--repeats",
        "1",
        "--threads",
        "1",
    ]
    out = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["samples"] == 8 and r["flat_response_lengths"] == [max(1, round(r["response_tokens"] / 8))]
    want = (r["floor_generation_s"] + r["floor_training_s"]) / (r["flat_generation_s"] + r["floor_training_s"])
    # python float64, the same quotient recomputed from the printed fields: a few ulp; approx's default
    assert r["streaming_bound"] == pytest.approx(want)


def test_same_node_bench_moves_through_shared_memory():
    """The bench's second process really used the shared-memory path (it asserts the warehouse
    did not refuse its memory) and reports both paths and their ratio."""
    from tests.conftest import subprocess_env

    out = subprocess.run(
        [sys.executable, str(REPO / "tools/bench_same_node.py"), "--mib", "0.5", "--samples", "16", "--repeats", "2"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    out = out.stdout
    assert "wire" in out and "shared memory" in out and "wire / shared memory: get" in out


def test_bench_replay_summary_leaves_out_the_first_iteration_and_keeps_the_curve():
    import bench_replay

    rows = [
        {
            "iteration": 0,
            "iteration_s": 9.0,
            "time_actor_update": 5.0,
            "time_actor_rollout": 3.0,
            "logprob_mismatch_mean": 1.0,
            "eval_accuracy": 0.25,
        },
        {
            "iteration": 1,
            "iteration_s": 1.0,
            "time_actor_update": 0.5,
            "time_actor_rollout": 0.25,
            "logprob_mismatch_mean": 0.1,
            "router_agreement": 0.9,
            "routes_differ_tokens": 0.2,
        },
        {
            "iteration": 2,
            "iteration_s": 3.0,
            "time_actor_update": 1.5,
            "time_actor_rollout": 0.75,
            "logprob_mismatch_mean": 0.3,
            "router_agreement": 0.7,
            "routes_differ_tokens": 0.4,
            "eval_accuracy": 0.5,
        },
    ]
    s = bench_replay.summary(rows)
    assert s["curve"] == [(0, 0.25), (2, 0.5)] and s["iteration_s"] == 2.0 and s["update_s"] == 1.0
    assert (
        # ratios of small counts in float64 (this and the next 2 lines): a rounding each; approx's default
        s["mismatch"] == pytest.approx(0.2)
        and s["agreement"] == pytest.approx(0.8)
        and s["differ"] == pytest.approx(0.3)
    )
