"""PPO with a critic, end to end under real torchrun (2 ranks, real etcd, real vLLM), in the
FSDP and the TP layout, with KL in the reward (so the reference and old-log-prob stages run):

- the advantages and returns the dock holds equal a single-process float64 recomputation
  from the dock's own columns (token rewards, GAE, whitening over the whole iteration), written
  out here from verl's formulas, not through ``algos``;
- a PPO run killed mid-iteration resumes bit-exact (actor and critic);
- residency: while each stage runs, only the roles it declares (plus the pinned ones, plus the
  rollout engine on CPU, which vLLM cannot put to sleep) are resident, from the ledger; and each
  role's bytes match what ``spmd-rl plan`` predicts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch
from transformers import AutoModelForTokenClassification

from spmd_rl.config.layout import resolve_layouts
from spmd_rl.config.loader import load_config
from spmd_rl.recipe.train_backends import role_bytes
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.recipe.graph import resident_roles, stages_for
from spmd_rl.engines.training.safe_dcp import read_full_state
from spmd_rl.reshard.ledger import ROLE_CATEGORIES
from spmd_rl.trainer.checkpoint import role_folder
from tests.conftest import REPO
from tests.dock_dump import columns, dump_env, ledger
from tests.integration.test_restart_torchrun import ITERS, command, env
from tests.torchrun_util import kill_tree, wait_for, workers_of
from tests.trainer_util import N, train

GAMMA, LAM, BETA = 0.95, 0.9, 0.05
PPO = (
    "algorithm.name=ppo",
    f"algorithm.gamma={GAMMA}",
    f"algorithm.lam={LAM}",
    f"algorithm.kl_coef={BETA}",
    "algorithm.use_kl_loss=false",
    "algorithm.kl_estimator=k1",
    "algorithm.critic_lr=1e-3",
    "actor.ppo_epochs=2",
)
LAYOUTS = {
    "fsdp": ("parallel.train.dp_shard=2", "parallel.train.tp=1"),
    "tp": ("parallel.train.dp_shard=1", "parallel.train.tp=2", "critic.offload_to_host=false"),
}


def reference_gae(col: dict[str, dict[int, torch.Tensor]]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """verl's compute_gae_advantage_return + apply_kl_penalty + masked_whiten, in float64,
    over every sample of the iteration at once."""
    idx = sorted(col["advantages"])
    adv_raw, ret = {}, {}
    for i in idx:
        L = int(col["response_length"][i])
        v = col["values"][i].double()
        kl = col["old_log_prob"][i].double() - col["ref_log_prob"][i].double()  # k1 = log pi_old - log ref
        r = -BETA * kl
        r[L - 1] += float(col["reward"][i])
        a, last = torch.zeros(L, dtype=torch.float64), 0.0
        for t in reversed(range(L)):
            nxt = float(v[t + 1]) if t + 1 < L else 0.0
            last = float(r[t]) + GAMMA * nxt - float(v[t]) + GAMMA * LAM * last
            a[t] = last
        adv_raw[i], ret[i] = a, a + v
    flat = torch.cat([adv_raw[i] for i in idx])
    mean, var = flat.mean(), flat.var(unbiased=True)
    return {i: (adv_raw[i] - mean) / torch.sqrt(var + 1e-8) for i in idx}, ret


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ppo_gae_and_residency(tiny_model, tmp_path, etcd, layout):
    dump = tmp_path / "dump"
    overrides = (*PPO, *LAYOUTS[layout], "trainer.iterations=2")
    if layout == "fsdp":  # the critic's value forward and update in micro-batches of at most 100 tokens
        overrides += ("actor.micro_batch_tokens=100",)
    if layout == "tp":  # the critic from its own folder: a value model with a non-zero head
        torch.manual_seed(0)
        AutoModelForTokenClassification.from_pretrained(tiny_model, num_labels=1).save_pretrained(tmp_path / "critic")
        overrides += (f"critic.model_path={tmp_path / 'critic'}",)
    rows = train(tmp_path, layout, etcd.endpoint, *overrides, extra_env=dump_env(dump))
    assert [r["iteration"] for r in rows] == [0, 1]
    for r in rows:
        # 16 samples of about 30 tokens per rank: 2 of micro_batch_size 8, more under 100 tokens (fsdp);
        # tp: all 32 samples on each rank, 4 micro-batches of 8
        assert r["micro_batches"] > 2 if layout == "fsdp" else r["micro_batches"] == 4
        assert (
            r["value_loss"] > 0 and "critic_grad_norm" in r and r["critic_lr"] == 1e-3
        )  # algorithm.critic_lr, not the actor's
    assert (rows[0]["values_mean"] == 0) == (
        layout == "fsdp"
    )  # the actor's folder has no value head: it starts at zero
    assert (
        rows[0]["kl_reward"] == 0 and rows[1]["kl_reward"] != 0
    )  # the actor equals the reference until its first step
    by_it = columns(dump)
    for it, col in by_it.items():
        assert len(col["advantages"]) == len(col["returns"]) == len(col["values"]) == len(col["reward"])
        want_adv, want_ret = reference_gae(col)
        for i in col["advantages"]:
            assert col["advantages"][i].numel() == int(col["response_length"][i])
            # float32 dock columns of GAE/whitening (eps 6e-8 x |A| <= ~5) vs the float64 reference (and the next line)
            torch.testing.assert_close(col["advantages"][i].double(), want_adv[i], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(col["returns"][i].double(), want_ret[i], atol=1e-5, rtol=1e-5)

    cfg = load_config(
        REPO / "configs/quickstart.yaml",
        [
            "data.global_batch_size=8",
            f"rollout.n={N}",
            "actor.mini_batch_size=8",
            "actor.micro_batch_size=8",
            *overrides,
        ],
    )
    lay, _ = resolve_layouts(cfg, 2, 2)
    arch = ModelArch.from_folder(tiny_model)
    predicted = role_bytes(cfg, arch, lay, critic_arch=arch)
    for rank in (0, 1):
        book = ledger(dump, rank)
        graph = stages_for(cfg)
        for stage in graph:
            row = [r for r in book if r["phase"] == stage.name][-1]  # iteration 1: the optimizers hold state
            resident = {role for role, cats in ROLE_CATEGORIES.items() if any(row[c] for c in cats)}
            # a stage without roles (advantage) keeps what the stage before it had
            assert resident - {"rollout"} == resident_roles(cfg, stage, graph) - {"rollout"}, (stage.name, resident)
            for role in set(stage.roles) - {"rollout"}:
                got = sum(row[c] for c in ROLE_CATEGORIES[role])
                assert abs(got - predicted[role]) <= 0.05 * predicted[role], (stage.name, role, got, predicted[role])


@pytest.mark.slow
def test_ppo_killed_mid_iteration_resumes_bit_exact(tiny_model, tmp_path):
    """Deterministic PPO: SIGKILL a worker during iteration 2; torchrun restarts the group from
    the iteration-2 checkpoint (actor, critic, both optimizers, sampler, RNG) and the final
    weights of both models equal an uninterrupted run's bit for bit."""
    ppo = ("algorithm.name=ppo", "algorithm.critic_lr=1e-3", f"algorithm.gamma={GAMMA}", f"algorithm.lam={LAM}")
    clean = subprocess.run(
        command(tmp_path, "clean", *ppo), cwd=REPO, env=env(), capture_output=True, text=True, timeout=600
    )
    assert clean.returncode == 0, clean.stderr[-3000:]
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(
        command(tmp_path, "killed", *ppo), cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT
    )
    metrics = tmp_path / "killed/logs/metrics.jsonl"
    try:
        wait_for(
            lambda: (
                metrics.exists()
                and len(metrics.read_text().splitlines()) >= 2
                and (tmp_path / "killed/ckpt/iter_000002").is_dir()
            ),
            300,
            "iteration 2 to start",
        )
        victims = workers_of(proc.pid)
        assert victims, "no worker found to kill"
        os.kill(victims[-1], signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, (tmp_path / "killed.log").read_text()[-4000:]
    finally:
        kill_tree(proc)
        log.close()
    assert "resumed from" in (tmp_path / "killed.log").read_text()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(ITERS))
    for role in ("actor", "critic"):
        a = read_full_state(role_folder(tmp_path / f"clean/ckpt/iter_{ITERS:06d}", role))
        b = read_full_state(role_folder(tmp_path / f"killed/ckpt/iter_{ITERS:06d}", role))
        assert a["model"].keys() == b["model"].keys() and all(
            torch.equal(a["model"][k], b["model"][k]) for k in a["model"]
        ), role
        assert any(k.startswith("score.") for k in a["model"]) == (role == "critic")
