"""The trainer learns the quickstart task in every synchronous and streaming mode, judged on
what a user would judge: held-out greedy accuracy (all 500 test prompts, vLLM greedy) of the
*final* policy against the start, with a margin. Training reward at T = 1 is not used: entropy
collapse raises it without the policy getting better.

Both accuracies come from the run's own evaluator (``trainer.eval_interval``): the start is the
eval before iteration 0 (the warm-started model), the end is ``final_eval_accuracy``, the policy
after the last update, which is what the last checkpoint holds. The GRPO mode also evaluates that
checkpoint with ``spmd-rl eval`` in a fresh process and must find the same accuracy, so the
in-run number is the checkpoint's. The margin (``MARGIN``) is about three standard errors of the
difference between two accuracies on these 500 prompts near 25 % (each about 0.019), so a run
that did not learn fails it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, subprocess_env
from tests.trainer_util import train

ITERS = 60
MARGIN = 0.06
QUICKSTART = ("data.global_batch_size=16", "rollout.n=8", "actor.mini_batch_size=16", "actor.micro_batch_size=32")
MODES = {
    "grpo": [],
    "dapo": ["algorithm.name=dapo", "algorithm.dynamic_sampling=true", "algorithm.max_extra_rounds=2"],
    "partial": ["stream.partial_tokens=4", "actor.tis_cap=2.0"],
    "megatron": ["actor.backend=megatron", "parallel.train.tp=2", "parallel.train.dp_shard=1", "parallel.train.sequence_parallel=true"],
    "megatron-pp2": ["actor.backend=megatron", "parallel.train.pp=2", "parallel.train.dp_shard=1"],
    # the Qwen3-MoE sibling (same task and test set): FSDP over the fused experts recording the
    # rollout's routes (router metrics), megatron with EP 2 replaying them (R3)
    "moe": ["model.path=assets/tiny-qwen3-moe", "actor.router_replay=record"],
    "megatron-moe-ep2": ["model.path=assets/tiny-qwen3-moe", "actor.backend=megatron", "parallel.train.ep=2", "actor.router_replay=rollout"],
    "separated": ["parallel.placement=separated", "parallel.gen_ranks=1", "parallel.gen.dp=1", "parallel.train.dp_shard=1",
                  "actor.tis_cap=2.0"],
    # the critic-free estimators and CISPO (issue 36)
    "rloo": ["algorithm.name=rloo"],
    "reinforce_pp": ["algorithm.name=reinforce_pp"],
    "cispo": ["actor.policy_loss=cispo"],
    # LoRA RL (issue 36): rank-16 adapters on every projection, at the learning rate LoRA needs
    "lora": ["actor.lora.rank=16", "actor.lora.alpha=32", "actor.lr=1e-3"],
}

LONGER = {"rloo": 100, "lora": 200}
"""RLOO's advantages are not divided by the group std: for this task's 0/1 rewards about 2.5x
smaller than GRPO's. Its training reward rose as GRPO's did (40 iterations: 0.129 -> 0.191
against 0.127 -> 0.184), but 60 iterations moved held-out greedy accuracy only 0.240 -> 0.248,
and a larger learning rate made it worse (2e-4: 0.130; 3e-4: 0.022)."""


MARGINS = {"lora": 0.12}
"""LoRA is asked to gain 15 points on the quickstart. Its 200-iteration run gained 15.8
(0.240 -> 0.398, full fine-tuning's at the same length: see docs/benchmarks.md); the test
keeps two standard errors below that."""


def held_out_accuracy(model: str) -> float:
    res = subprocess.run([sys.executable, "-m", "spmd_rl.cli", "eval", model, "--data", "assets/tiny-qwen2/test.jsonl"],
                         cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["prompts"] == 500
    return got["accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_final_checkpoint_beats_the_start_on_held_out_prompts(request, tiny_model, tmp_path, etcd, mode):
    if "moe" in mode:
        request.getfixturevalue("tiny_moe")  # built by the setup, or here when missing
    iters = LONGER.get(mode, ITERS)
    rows = train(tmp_path, mode, etcd.endpoint, *QUICKSTART, *MODES[mode], f"trainer.iterations={iters}", "checkpoint.interval=0",
                 f"trainer.eval_interval={iters}")
    start, final = rows[0]["eval_accuracy"], rows[-1]["final_eval_accuracy"]
    assert "final_eval_accuracy" not in rows[-2]  # logged once, on the last iteration's row
    if mode == "grpo":  # the in-run final eval scored the weights the last checkpoint holds
        offline = held_out_accuracy(str(tmp_path / mode / f"ckpt/iter_{iters:06d}"))
        assert abs(offline - final) <= 0.01, (offline, final)  # greedy near-ties may flip between engine layouts
    late_entropy = sum(r["entropy"] for r in rows[-10:]) / 10
    print(f"{mode}: held-out greedy accuracy {start:.3f} -> {final:.3f} after {iters} iterations; "
          f"entropy first {rows[0]['entropy']:.3f}, last 10 {late_entropy:.3f}")
    assert final - start >= MARGINS.get(mode, MARGIN), (start, final)
    if mode in ("grpo", "megatron", "megatron-pp2", "moe", "megatron-moe-ep2", "rloo", "reinforce_pp", "cispo", "lora"):  # float32: trainer and vLLM agree after every sync (with two stages:
        assert max(r["logprob_mismatch_max"] for r in rows) < 1e-3  # vLLM got each stage's layers, the trainer the last stage's log-probs)
    if "moe" in mode:  # float32: the trainer's routers choose what vLLM's chose, but where a near-tie flips
        assert min(r["router_agreement"] for r in rows) > 0.99 and all(r["expert_load_max_mean"] >= 1.0 for r in rows)
    if mode.startswith("megatron"):  # the fields acted: mcore built the layout asked for, and wrote its own checkpoint keys
        layout = {"megatron": "tp=2 sequence_parallel=True pp=1 dp=1", "megatron-pp2": "tp=1 sequence_parallel=False pp=2 dp=1",
                  "megatron-moe-ep2": "tp=1 sequence_parallel=False pp=1 dp=2 ep=2 (4 experts)"}[mode]
        assert f"actor: megatron-core GPTModel {layout}" in (tmp_path / mode / "stderr.log").read_text()
        from spmd_rl.engines.safe_dcp import verify
        assert "optim.step" in verify(tmp_path / mode / f"ckpt/iter_{iters:06d}").state_dict_metadata
