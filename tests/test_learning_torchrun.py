"""The trainer learns the quickstart task in every synchronous and streaming mode, judged on
what a user would judge: held-out greedy accuracy (all 500 test prompts, vLLM greedy) against
the warm-started start. Training reward at T = 1 is not used: entropy collapse raises it without
the policy getting better.

The run's own evaluator (``trainer.eval_interval``) scores the same 500 prompts before iteration
0 (the start), every ``EVERY`` iterations and after the last update (``final_eval_accuracy``,
what the last checkpoint holds), and records which prompts each evaluation got right
(``eval_prompts.jsonl``). A mode has learned when either holds:

- the final policy beats the start by ``MARGIN`` (about three standard errors of the difference
  of two independent accuracies on 500 prompts near 25 %, each about 0.019): the check this test
  always made, then on a separate ``spmd-rl eval`` of the last checkpoint;
- a paired test over prompts: for prompt i, d_i = (the fraction of the later evaluations that
  got it right) - (1 if the start got it right); the mean of d, the gain of the mean held-out
  accuracy over the run, is at least Z = 3 of its standard errors (one-sided: a policy whose
  accuracy on such prompts did not change passes with probability about 0.13 %) and at least
  ``MIN_GAIN``.

A run that did not learn passes with probability at most the sum of the two rates. The second
exists because one policy's greedy accuracy swings from one evaluation to the next (about
+-0.04 on this task): on an Intel AMX machine GRPO went 0.242 -> 0.336 after 10 iterations and
was at 0.264 after 60, so the final evaluation alone failed a run that had learned. Pairing
removes the prompts both evaluations get right or wrong from the noise, and the mean over
several evaluations removes most of the swing.

The GRPO mode also evaluates the last checkpoint with ``spmd-rl eval`` in a fresh process: it
must find the final in-run accuracy, so the in-run number is the checkpoint's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env
from tests.trainer_util import train

ITERS = 60
EVERY = 10
MARGIN = 0.06
Z = 3.0
MIN_GAIN = 0.03
"""A gain that is significant but tiny (a few prompts that no evaluation lost) is not learning
the task: the mean held-out accuracy must also rise by 3 points."""
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


FINAL_GAIN = {"lora": 0.12}
"""LoRA is asked to gain 15 points on the quickstart by its last policy. Its 200-iteration run
gained 15.8 (0.240 -> 0.398, full fine-tuning's at the same length: see docs/benchmarks.md); the
test keeps two standard errors below that."""


def held_out_accuracy(model: str) -> float:
    res = subprocess.run([sys.executable, "-m", "spmd_rl.cli", "eval", model, "--data", "assets/tiny-qwen2/test.jsonl"],
                         cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["prompts"] == 500
    return got["accuracy"]


def paired_gain(record: Path) -> tuple[float, float, list[float]]:
    """From ``eval_prompts.jsonl``: the mean over prompts of d_i (module docstring), its standard
    error, and each evaluation's accuracy (the start first)."""
    evals = [json.loads(line) for line in record.read_text().splitlines()]
    n = evals[0]["prompts"]
    assert n == 500 and all(e["prompts"] == n for e in evals) and len(evals) >= 2, evals
    start, later = set(evals[0]["correct"]), [set(e["correct"]) for e in evals[1:]]
    d = [sum(i in c for c in later) / len(later) - (i in start) for i in range(n)]
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    return mean, se, [len(e["correct"]) / n for e in evals]


def test_the_paired_gain_is_the_mean_accuracy_gain_and_its_error_is_the_paired_one(tmp_path):
    """On made-up evaluations: 500 prompts, the start right on 0-99; two later evaluations right
    on 0-139 and on 20-159 (each 140 right: +8 points)."""
    rows = [range(100), range(140), range(20, 160)]
    (tmp_path / "e.jsonl").write_text("".join(json.dumps({"iteration": 10 * k, "prompts": 500, "correct": list(r)}) + "\n"
                                              for k, r in enumerate(rows)))
    mean, se, accs = paired_gain(tmp_path / "e.jsonl")
    assert accs == [0.2, 0.28, 0.28] and mean == pytest.approx(0.08)
    # d: 0-19 -> -0.5, 20-99 -> 0, 100-139 -> +1, 140-159 -> +0.5, the rest 0
    d = [-0.5] * 20 + [0.0] * 80 + [1.0] * 40 + [0.5] * 20 + [0.0] * 340
    assert se == pytest.approx(math.sqrt(sum((x - 0.08) ** 2 for x in d) / 499 / 500))
    assert se < math.sqrt(2 * 0.28 * 0.72 / 500)  # far below the unpaired error of two accuracies


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_the_policy_beats_the_start_on_held_out_prompts(request, tiny_model, tmp_path, etcd, mode):
    if "moe" in mode:
        request.getfixturevalue("tiny_moe")  # built by the setup, or here when missing
    iters = LONGER.get(mode, ITERS)
    rows = train(tmp_path, mode, etcd.endpoint, *QUICKSTART, *MODES[mode], f"trainer.iterations={iters}", "checkpoint.interval=0",
                 f"trainer.eval_interval={EVERY}")
    mean, se, accs = paired_gain(tmp_path / mode / "logs/eval_prompts.jsonl")
    start, final = rows[0]["eval_accuracy"], rows[-1]["final_eval_accuracy"]
    assert accs[0] == start and accs[-1] == final and len(accs) == iters // EVERY + 1  # the record is what the rows logged
    if mode == "grpo":  # the in-run final eval scored the weights the last checkpoint holds
        offline = held_out_accuracy(str(tmp_path / mode / f"ckpt/iter_{iters:06d}"))
        assert abs(offline - final) <= 0.01, (offline, final)  # greedy near-ties may flip between engine layouts
    late_entropy = sum(r["entropy"] for r in rows[-10:]) / 10
    print(f"{mode}: held-out greedy accuracy every {EVERY} iterations {' '.join(f'{a:.3f}' for a in accs)}; paired gain of the mean "
          f"{mean:+.3f} (standard error {se:.3f}); entropy first {rows[0]['entropy']:.3f}, last 10 {late_entropy:.3f}")
    assert final - start >= MARGIN or mean >= max(Z * se, MIN_GAIN), (mean, se, accs)
    if mode in FINAL_GAIN:
        assert final - start >= FINAL_GAIN[mode], (start, final)
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
