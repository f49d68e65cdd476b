"""The whole SPMD trainer under real torchrun (2 ranks, real etcd, real vLLM): four iterations
in the distributed dock, and in the centralized dock with stage fusion (the same weights bit
for bit), and resume from the iteration-1 checkpoint reproducing the rest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from spmd_rl.data.prompts import encode_prompts
from spmd_rl.rewards.registry import exact_match
from spmd_rl.trainer.checkpoint import model_weights
from tests.conftest import REPO, subprocess_env
from tests.trainer_util import G, N, train


@pytest.mark.slow
def test_two_iterations_both_modes_and_resume(tiny_model, tmp_path, etcd):
    """The distributed dock, against one run that changes two things: the centralized dock and
    stage fusion. Each only moves work (in space, in time) and neither may change a bit of the
    result, so the two runs must agree; a bug in either breaks that."""
    sched = ("actor.optim.lr_schedule=cosine", "actor.optim.warmup_steps=2", "trainer.iterations=4")
    runs = {
        "distributed": train(tmp_path, "distributed", etcd.endpoint, "dock.mode=distributed", *sched),
        "centralized-fused": train(
            tmp_path,
            "centralized-fused",
            etcd.endpoint,
            "dock.mode=centralized",
            *sched,
            "stream.fuse=true",
            "stream.micro_batch_size=2",
        ),
    }
    for mode, rows in runs.items():
        assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
        for r in rows:
            assert r["samples"] == G * N  # every sample got a reward, an advantage and an update
            assert all(map(lambda k: torch.isfinite(torch.tensor(r[k])).item(), ("loss", "grad_norm", "entropy")))
            assert r["grad_norm"] >= 0 and 0 <= r["accuracy"] <= 1
            assert (
                0 < r["generation_s_min"] <= r["generation_s_max"] <= r["iteration_s"]
            )  # the two generation ranks' times
    # the same seed and weights give the same samples, whichever dock holds them and when the
    # stages run; the same weights after every update (deterministic)
    a = model_weights(tmp_path / "distributed/ckpt/iter_000004")
    f = model_weights(tmp_path / "centralized-fused/ckpt/iter_000004")
    assert all(torch.equal(a[k], f[k]) for k in a)
    fused = runs["centralized-fused"]
    for r, u in zip(fused, runs["distributed"]):
        assert {k: r[k] for k in ("reward_mean", "accuracy", "adv_zero_groups", "loss", "grad_norm")} == {
            k: u[k] for k in ("reward_mean", "accuracy", "adv_zero_groups", "loss", "grad_norm")
        }
        assert r["fused_waves_early"] + r["fused_waves_late"] > 0 and "fused_waves_early" not in u
    assert sum(r["fused_waves_early"] for r in fused) > 0  # some waves ran while generation was still going
    ran = json.loads((tmp_path / "centralized-fused/logs/config.json").read_text())
    assert ran["dock"]["mode"] == "centralized" and ran["stream"]["fuse"] is True
    # warm-up then cosine: 0 -> peak -> decayed, and a resumed run logs the same lr
    lrs = [r["lr"] for r in runs["distributed"]]
    assert lrs == pytest.approx([0.5e-4, 1e-4, 1e-4, 0.5e-4])  # warm-up over 2 steps, cosine over the other 2
    first = tmp_path / "distributed/ckpt/iter_000001"
    resumed = train(tmp_path, "resumed", etcd.endpoint, "dock.mode=distributed", *sched, f"checkpoint.resume={first}")
    assert [r["iteration"] for r in resumed] == [1, 2, 3]
    assert [r["reward_mean"] for r in resumed] == [r["reward_mean"] for r in runs["distributed"][1:]]
    assert [r["lr"] for r in resumed] == lrs[1:]
    b = model_weights(tmp_path / "resumed/ckpt/iter_000004")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = model_weights(first)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # the later iterations did change the weights
    _export_and_eval_round_trip(tmp_path, tmp_path / "distributed/ckpt/iter_000004", a)


def _export_and_eval_round_trip(tmp: Path, ckpt: Path, weights: dict) -> None:
    """The exported HF folder holds the checkpoint's weights bit for bit with the tie kept, and
    `spmd-rl eval` on it equals HF greedy accuracy on the same prompts."""
    folder = tmp / "exported"
    res = subprocess.run(
        [sys.executable, "-m", "spmd_rl.cli", "export", str(ckpt), "--out", str(folder)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    saved = load_file(folder / "model.safetensors")
    assert all(torch.equal(saved[k], weights[k]) for k in saved) and set(saved) <= set(weights)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])
    data, limit = REPO / "assets/tiny-qwen2/test.jsonl", 40
    res = subprocess.run(
        [sys.executable, "-m", "spmd_rl.cli", "eval", str(folder), "--data", str(data), "--limit", str(limit)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    tok = AutoTokenizer.from_pretrained(folder)
    rows = [json.loads(x) for x in data.read_text().splitlines()[:limit]]
    correct = 0
    for row in rows:
        ids = encode_prompts(tok, [row["prompt"]], True)[0]
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        correct += exact_match(tok.decode(out[0, len(ids) :], skip_special_tokens=True), row["answer"]) > 0.5
    assert got["correct"] == correct, (got, correct)


@pytest.mark.slow
def test_reference_old_logprob_and_dapo_stages(tiny_model, tmp_path, etcd):
    """KL against the reference (host-offloaded between uses), off-policy update with the old
    log-prob pass (2 PPO epochs, 2 mini-batches), DAPO dynamic sampling."""
    rows = train(
        tmp_path,
        "dapo",
        etcd.endpoint,
        "algorithm.name=dapo",
        "algorithm.kl_coef=0.05",
        "actor.ppo_epochs=2",
        f"actor.mini_batch_size={G // 2}",
        "actor.micro_batch_size=4",
        "algorithm.dynamic_sampling=true",
        "ref.offload_to_host=false",
        "ref.micro_batch_size=2",
    )
    for r in rows:
        assert r["samples"] == G * N and "time_ref_logprob" in r and "time_actor_logprob" in r
        assert torch.isfinite(torch.tensor([r["loss"], r["kl"], r["entropy"]])).all()
        assert r["kl"] >= 0 and 1 <= r["dapo_rounds"] <= 3
        assert r["ref_resident_bytes"] > 0  # ref.offload_to_host=false keeps the reference resident
