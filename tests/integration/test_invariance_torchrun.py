"""End-to-end invariants of the update under real torchrun (2 ranks, real etcd, real vLLM):

- the same iteration with micro-batches of 16 or 4 samples, or of at most 100 tokens, gives the
  same loss and grad norm;
- training layout dp_shard=2 or tp=2 (same generation layout, so the same samples) gives the
  same loss and grad norm, although the two DP ranks hold different token counts;
- at temperature 0.7 the trainer's log-probs of the sampled tokens equal vLLM's;
- DAPO dynamic sampling trains only on signal-carrying groups, G of them, in bfloat16, and
  selects the same groups when the reward runs fused into generation (``stream.fuse``).
"""

from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM

from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.engines.training.logprobs import build_batch, response_logprobs
from spmd_rl.engines.training.token_logprob import SamplingPolicy
from spmd_rl.trainer.ledger import PromptLedger, problems
from tests.conftest import run_helper
from tests.trainer_util import G, N, train

ONE = ("trainer.iterations=1", "checkpoint.interval=0")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@pytest.mark.slow
def test_micro_batch_size_does_not_change_the_objective(tiny_model, tmp_path, etcd):
    split = {16: (), 4: (), "tokens": ("actor.micro_batch_tokens=100",)}  # 16 samples per rank, about 30 tokens each
    rows = {
        m: train(
            tmp_path,
            f"micro{m}",
            etcd.endpoint,
            *ONE,
            f"actor.micro_batch_size={16 if m == 'tokens' else m}",
            *extra,
            "actor.loss.loss_agg_mode=seq-mean-token-mean",
            "algorithm.kl_coef=0.05",
        )[0]
        for m, extra in split.items()
    }
    a = rows[16]
    assert (a["micro_batches"], rows[4]["micro_batches"]) == (1, 4)
    assert 1 < rows["tokens"]["micro_batches"] < 16  # by tokens, the same count on both ranks (else FSDP would hang)
    for b in (rows[4], rows["tokens"]):
        assert a["reward_mean"] == b["reward_mean"]  # the same samples
        assert (
            a["ref_resident_bytes"] == b["ref_resident_bytes"] == 0
        )  # ref.offload_to_host (default): on host between uses
        # float32: micro-batches of 16, 4 or <= 100 tokens sum the same gradient in other orders, rel ~1e-6 (this and
        # the next line; abs 1e-7 where the loss is ~0)
        assert _rel(a["grad_norm"], b["grad_norm"]) < 1e-5, (a["grad_norm"], b["grad_norm"])
        assert _rel(a["loss"], b["loss"]) < 1e-5 or abs(a["loss"] - b["loss"]) < 1e-7, (a["loss"], b["loss"])


@pytest.mark.slow
def test_training_layout_does_not_change_the_objective_and_logprobs_match_vllm(tiny_model, tmp_path, etcd):
    layouts = {
        "fsdp": ("parallel.train.dp_shard=2", "parallel.train.tp=1"),
        "tp": ("parallel.train.dp_shard=1", "parallel.train.tp=2"),
    }
    rows = {
        k: train(tmp_path, k, etcd.endpoint, *ONE, *v, "rollout.temperature=0.7", "actor.micro_batch_size=4")[0]
        for k, v in layouts.items()
    }
    a, b = rows["fsdp"], rows["tp"]
    assert a["reward_mean"] == b["reward_mean"] and a["response_length_max"] > 1
    # float32: FSDP vs TP sum the same gradient in other orders, rel ~1e-6 (this and the next line; abs 1e-7 at ~0)
    assert _rel(a["grad_norm"], b["grad_norm"]) < 1e-5, (a["grad_norm"], b["grad_norm"])
    assert _rel(a["loss"], b["loss"]) < 1e-5 or abs(a["loss"] - b["loss"]) < 1e-7, (a["loss"], b["loss"])
    for r in rows.values():  # the trainer's policy is softmax(logits / 0.7), as vLLM's sampler's
        # float32: vLLM's CPU forward vs the trainer's, each ~1e-5 from float64 (test_megatron_torchrun); 1e-4 ~7x
        assert r["logprob_mismatch_max"] < 1e-4, r["logprob_mismatch_max"]


@pytest.mark.slow
def test_rollout_logprobs_equal_an_hf_forward_at_the_temperature(tiny_model):
    """Independent reference for the metric above: an HF float32 forward of the sampled tokens
    at T=0.7 equals the rollout engine's log-probs; without the temperature (the old trainer)
    it does not."""
    got = run_helper("rollout_logprobs.py", tiny_model, 0.7)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    prompt = torch.tensor(got["prompt"])
    responses = [torch.tensor(s["ids"]) for s in got["samples"]]
    batch = build_batch([prompt] * len(responses), responses, 0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    right = response_logprobs(logits, batch, policy=SamplingPolicy(0.7))[0]
    wrong = response_logprobs(logits, batch)[0]
    for k, s in enumerate(got["samples"]):
        vllm = torch.tensor(s["logprobs"])
        # float32: HF vs vLLM CPU forwards, each ~1e-5 from float64; 1e-4 ~7x
        assert (right[k, : len(vllm)] - vllm).abs().max() < 1e-4
    assert (
        max(
            float((wrong[k, : len(s["ids"])] - torch.tensor(s["logprobs"])).abs().max())
            for k, s in enumerate(got["samples"])
        )
        > 1e-2
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [SamplingPolicy(1.0, top_p=0.7), SamplingPolicy(1.2, top_k=3), SamplingPolicy(0.9, top_k=4, top_p=0.8)],
    ids=str,
)
def test_rollout_logprobs_under_top_p_top_k_are_the_trainers(tiny_model, policy):
    """With top-p / top-k the rollout's log-probs are of the truncated policy; the trainer's
    kernel (``token_logprob`` with the same policy) on an HF float32 forward equals them, and so
    does an HF reference built from transformers' own warpers. The untruncated softmax(logits / T),
    what the trainer computed before, differs (so this test fails on the old trainer)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    got = run_helper(
        "rollout_logprobs.py", tiny_model, policy.temperature, f"top_p={policy.top_p}", f"top_k={policy.top_k}", "n=16"
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    responses = [torch.tensor(s["ids"]) for s in got["samples"]]
    batch = build_batch([torch.tensor(got["prompt"])] * len(responses), responses, 0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    trainer = response_logprobs(logits, batch, policy=policy)[0]
    untruncated = response_logprobs(logits, batch, policy=SamplingPolicy(policy.temperature))[0]
    x = TemperatureLogitsWarper(policy.temperature)(None, logits.double().flatten(0, 1))
    x = TopKLogitsWarper(policy.top_k)(None, x) if policy.top_k > 0 else x
    x = TopPLogitsWarper(policy.top_p)(None, x) if policy.top_p < 1 else x
    hf = torch.log_softmax(x, -1).view(*logits.shape)
    worst_old = 0.0
    for k, s in enumerate(got["samples"]):
        vllm, r = torch.tensor(s["logprobs"]), len(s["ids"])
        pos = batch.predictor[k, :r]
        ref = hf[k, pos, torch.tensor(s["ids"])].float()
        assert ref.isfinite().all()  # every sampled token is in HF's kept set
        # float32: trainer kernel / HF warpers vs vLLM CPU forwards, each ~1e-5 from float64; 1e-4 ~7x
        assert (trainer[k, :r] - vllm).abs().max() < 1e-4 and (ref - vllm).abs().max() < 1e-4
        worst_old = max(worst_old, float((untruncated[k, :r] - vllm).abs().max()))
    assert worst_old > 1e-2, worst_old


@pytest.mark.slow
def test_dapo_dynamic_sampling_trains_only_signal_groups_in_bf16(tiny_model, tmp_path, etcd):
    rows = train(
        tmp_path,
        "dapo-ds",
        etcd.endpoint,
        *ONE,
        "algorithm.name=dapo",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_extra_rounds=4",
        "reward.rule=tests.helpers.rewards:half_constant",
        "model.dtype=bfloat16",
    )
    r = rows[0]
    assert r["dapo_kept_groups"] == G and r["dapo_filler_groups"] == 0
    assert r["dapo_rounds"] >= 2  # about half the groups are constant: one round cannot give G
    assert r["dapo_discarded_groups"] == r["dapo_rounds"] * G - G
    assert r["generated_samples"] == r["dapo_rounds"] * G * N and r["samples"] == G * N
    assert r["adv_zero_groups"] == 0  # the update saw no constant group
    assert r["grad_norm"] > 0 and 0 <= r["logprob_mismatch_mean"] < 0.1  # bf16 rollout vs bf16 trainer
    fused = train(
        tmp_path,
        "dapo-ds-fused",
        etcd.endpoint,
        *ONE,
        "algorithm.name=dapo",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_extra_rounds=4",
        "reward.rule=tests.helpers.rewards:half_constant",
        "model.dtype=bfloat16",
        "stream.fuse=true",
        "stream.micro_batch_size=4",
    )[0]
    for k in ("dapo_rounds", "dapo_kept_groups", "dapo_discarded_groups", "generated_samples", "grad_norm", "loss"):
        assert fused[k] == r[k], (
            k,
            fused[k],
            r[k],
        )  # the fused reward (waves, merged per round) selects the same groups
    assert fused["fused_waves_early"] + fused["fused_waves_late"] > 0
    (step,) = PromptLedger(MetadataStore([etcd.endpoint], job="t-dapo-ds.ledger")).read()  # the prompt ledger
    assert problems([step]) == [] and len(step.trained) == G and len(step.sampled) == r["dapo_rounds"] * G
    assert len(step.dropped) == r["dapo_discarded_groups"] and all(
        v.startswith("dynamic sampling: ") for v in step.dropped.values()
    )
