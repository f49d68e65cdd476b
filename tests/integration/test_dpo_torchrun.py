"""DPO through ``spmd-rl train`` (real torchrun, etcd; no vLLM: the DPO graph has no rollout):

- at iteration 0 the policy is the reference, so every pair's loss is log 2 and the margin 0;
- split invariance end to end: 2 FSDP ranks with 8-pair micro-batches or 2 TP ranks with
  2-pair ones give the same loss and gradient;
- learning: the held-out pairs' margin D_c - D_r (``spmd-rl eval --pairs``, HF forwards in
  float64 against the base model) grows from 0, and most held-out pairs are ranked right;
- LoRA: the reference is the base model with adapters off, the same objective at iteration 0.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, subprocess_env
from tests.trainer_util import train

DPO = (
    "algorithm.name=dpo",
    "rollout.n=2",
    "eval.interval=0",
    "data.train_path=assets/tiny-qwen2/preferences_train.jsonl",
    "checkpoint.interval=0",
)
LAYOUTS = {
    "dp2-micro16": ("parallel.train.dp_shard=2", "parallel.train.tp=1", "actor.micro_batch_size=16"),
    "tp2-micro4": ("parallel.train.dp_shard=1", "parallel.train.tp=2", "actor.micro_batch_size=4"),
}
ITERS = 100


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@pytest.fixture(scope="module")
def preferences(tiny_model):
    if not (tiny_model / "preferences_train.jsonl").is_file():
        subprocess.run(
            [sys.executable, str(REPO / "tools/make_preference_data.py"), "--model", str(tiny_model)], check=True
        )
    return tiny_model


@pytest.fixture(scope="module")
def learning_run(preferences, tmp_path_factory, etcd) -> tuple[list[dict], object]:
    """The 100-iteration DPO run (2 FSDP ranks, 16-pair micro-batches, lr 1e-4 as the quickstart):
    its metrics rows and checkpoint folder. Its iteration 0 is the dp2-micro16 layout below."""
    tmp = tmp_path_factory.mktemp("dpo")
    rows = train(
        tmp,
        "dpo",
        etcd.endpoint,
        *DPO,
        f"trainer.iterations={ITERS}",
        "data.global_batch_size=16",
        "actor.mini_batch_size=16",
        *LAYOUTS["dp2-micro16"],
        "actor.optim.lr=1e-4",
    )
    return rows, tmp / f"dpo/ckpt/iter_{ITERS:06d}"


@pytest.mark.slow
def test_dpo_objective_starts_at_log2_and_does_not_depend_on_the_split(preferences, learning_run, tmp_path, etcd):
    """At h = 0 the loss is log 2 and its gradient is -(1 - 2 eps) beta / 2 times that of
    D_c - D_r: ``dpo_beta`` 0.3 with ``dpo_label_smoothing`` 0.25 gives 1.5 x the grad norm of
    beta 0.1 without smoothing (0.5 x if beta were ignored, 3 x if eps were). The dp2-micro16
    layout is the learning run's iteration 0 (the same pairs, config and seed: its first update
    comes after the row's loss and gradient)."""
    run = lambda name, *extra: train(
        tmp_path,
        name,
        etcd.endpoint,
        *DPO,
        "trainer.iterations=1",  # noqa: E731
        "data.global_batch_size=16",
        "actor.mini_batch_size=16",
        *extra,
    )[0]
    a, b = learning_run[0][0], run("tp2-micro4", *LAYOUTS["tp2-micro4"])
    for r in (a, b):  # the policy is the reference: h = 0 for every pair
        # float32: log 2 (ulp 6e-8) averaged over the 16 pairs on 2 ranks, error ~1e-7
        assert abs(r["loss"] - math.log(2)) < 1e-6 and r["dpo_margin"] == 0.0 and r["grad_norm"] > 0
    assert _rel(a["grad_norm"], b["grad_norm"]) < 1e-5, (a["grad_norm"], b["grad_norm"])
    # float32: DP2/micro 16 vs TP2/micro 4 sum the same gradient in other orders; rel ~1e-6
    both = run("beta-eps", *LAYOUTS["dp2-micro16"], "algorithm.dpo_beta=0.3", "algorithm.dpo_label_smoothing=0.25")
    # float32: the same gradient scaled by (1 - 2 eps) beta / 2, rel ~1e-7; loose, it only tells 1.5x from 0.5x or 3x
    assert _rel(both["grad_norm"], 1.5 * a["grad_norm"]) < 1e-4, (both["grad_norm"], a["grad_norm"])
    want = reference_grad_norm(preferences, 16, 0.1)  # the mean over the 16 pairs, in one process, float64
    # float32 trainer (rel ~1e-6) vs the float64 HF reference gradient; loose (~100x), a wrong beta or mean is O(1)
    assert _rel(a["grad_norm"], want) < 1e-3, (a["grad_norm"], want)


def reference_grad_norm(model_dir, pairs: int, beta: float) -> float:
    """The DPO gradient's norm at iteration 0 computed apart from the trainer: the first
    ``pairs`` pairs the run's sampler hands out, an HF forward and backward in float64 of the
    mean loss over them (at h = 0, -beta/2 x the mean of grad(log pi(c) - log pi(r)))."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spmd_rl.algos.preference import dpo
    from spmd_rl.config.loader import load_config
    from spmd_rl.data.preferences import preferences_for
    from spmd_rl.data.sampler import sampler_for
    from spmd_rl.trainer.pair_eval import sequence_logprobs

    cfg = load_config(REPO / "configs/quickstart_dpo.yaml", [f"model.path={model_dir}"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = preferences_for(cfg, tok, model_dir / "preferences_train.jsonl")
    rows = sampler_for(cfg, len(data)).next_batch(pairs)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    prompts = [data.prompt_ids[r] for r in rows]
    lp_c = sequence_logprobs(model, prompts, [data.pairs[r][0] for r in rows], grad=True)
    lp_r = sequence_logprobs(model, prompts, [data.pairs[r][1] for r in rows], grad=True)
    dpo(lp_c, lp_r, lp_c.detach(), lp_r.detach(), beta).loss.mean().backward()
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))


@pytest.mark.slow
def test_dpo_grows_the_held_out_margin(learning_run):
    rows, ckpt = learning_run
    assert (
        rows[0]["dpo_margin"] == 0.0 and sum(r["dpo_margin"] for r in rows[-10:]) / 10 > 0.02
    )  # beta x margin on the training pairs
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd_rl.cli",
            "eval",
            str(ckpt),
            "--data",
            "assets/tiny-qwen2/preferences_test.jsonl",
            "--pairs",
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"dpo: held-out margin {got['margin']:.3f}, accuracy {got['accuracy']:.3f} over {got['pairs']} pairs")
    assert got["pairs"] == 500 and got["margin"] > 0.3 and got["accuracy"] > 0.58, got


@pytest.mark.slow
def test_dpo_with_lora_uses_the_base_model_as_reference(preferences, tmp_path, etcd):
    rows = train(
        tmp_path, "dpo-lora", etcd.endpoint, *DPO, "trainer.iterations=3", "actor.lora.rank=8", "actor.optim.lr=1e-3"
    )
    # float32: log 2 (ulp 6e-8) averaged over the pairs, error ~1e-7
    assert abs(rows[0]["loss"] - math.log(2)) < 1e-6 and rows[0]["dpo_margin"] == 0.0
    assert rows[2]["dpo_margin"] != 0.0  # the reference is the actor's own tensors, adapters off (test_lora's worker)
