"""The whole SPMD trainer under real torchrun (2 ranks, real etcd, real vLLM): two iterations
in both dock modes, and resume from the iteration-1 checkpoint reproducing iteration 2."""

from __future__ import annotations

import pytest
import torch

from spmd_rl.dock.etcd_server import EmbeddedEtcd
from spmd_rl.trainer.checkpoint import model_weights
from tests.trainer_util import G, N, train


@pytest.fixture(scope="module")
def etcd():
    with EmbeddedEtcd() as e:
        yield e


@pytest.mark.slow
def test_two_iterations_both_modes_and_resume(tiny_model, tmp_path, etcd):
    runs = {mode: train(tmp_path, mode, etcd.endpoint, f"dock.mode={mode}") for mode in ("distributed", "centralized")}
    for mode, rows in runs.items():
        assert [r["iteration"] for r in rows] == [0, 1]
        for r in rows:
            assert r["samples"] == G * N  # every sample got a reward, an advantage and an update
            assert all(map(lambda k: torch.isfinite(torch.tensor(r[k])).item(), ("loss", "grad_norm", "entropy")))
            assert r["grad_norm"] >= 0 and 0 <= r["accuracy"] <= 1
    # the same seed and weights give the same samples in both modes
    assert runs["distributed"][0]["reward_mean"] == runs["centralized"][0]["reward_mean"]
    # resume from the iteration-1 checkpoint of the distributed run
    first = tmp_path / "distributed/ckpt/iter_000001"
    resumed = train(tmp_path, "resumed", etcd.endpoint, "dock.mode=distributed", f"checkpoint.resume={first}")
    assert [r["iteration"] for r in resumed] == [1]
    assert resumed[0]["reward_mean"] == runs["distributed"][1]["reward_mean"]
    a = model_weights(tmp_path / "distributed/ckpt/iter_000002")
    b = model_weights(tmp_path / "resumed/ckpt/iter_000002")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = model_weights(first)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # iteration 2 did change the weights


@pytest.mark.slow
def test_reference_old_logprob_and_dapo_stages(tiny_model, tmp_path, etcd):
    """KL against the reference (host-offloaded between uses), off-policy update with the old
    log-prob pass (2 PPO epochs, 2 mini-batches), DAPO dynamic sampling."""
    rows = train(tmp_path, "dapo", etcd.endpoint, "algorithm.name=dapo", "algorithm.kl_coef=0.05", "actor.ppo_epochs=2",
                 f"actor.mini_batch_size={G // 2}", "actor.micro_batch_size=4", "algorithm.dynamic_sampling=true")
    for r in rows:
        assert r["samples"] == G * N and "time_ref_logprob" in r and "time_actor_logprob" in r
        assert torch.isfinite(torch.tensor([r["loss"], r["kl"], r["entropy"]])).all()
        assert r["kl"] >= 0 and 1 <= r["dapo_rounds"] <= 3
