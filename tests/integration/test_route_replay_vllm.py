"""Rollout routing replay against a real in-process vLLM on the tiny Qwen3-MoE
(tests/helpers/moe_routes.py: vLLM samples with routes recorded, then an HF float32 forward
scores the samples).

What a broken version would do and why it fails here:
- routes of the wrong request or shifted positions: the row count per sample is checked against
  prompt + response - 1, the prompt rows of the N samples of one prompt (computed separately,
  prefix caching off) must agree, and the replayed forward must equal an independent replay
  written in the helper (each sparse block recomputed from the recorded experts);
- tables that outlive their batch: one planted in vLLM's worker, as an unfinished request's would
  stay, must be gone after the next batch (``_begin_batch`` drops them);
- a layout bug in the packed path: packed replay must equal padded replay;
- replay that does nothing: with vLLM in bf16 some decisions differ from the float32 trainer's,
  and replaying them must bring the trainer's log-probs closer to vLLM's. The bf16 run uses a
  copy of the model with one near-tied router pair per layer (``near_tie_copy``): the tiny
  model's own margins depend on the CPU that built it, and on an AVX2-only build no bf16
  decision differed, which left this check showing nothing."""

from __future__ import annotations

import pytest

from tests.conftest import run_helper


@pytest.fixture(scope="module")
def fp32(tiny_moe):
    return run_helper("moe_routes.py", tiny_moe, "float32", timeout=600)


@pytest.fixture(scope="module")
def bf16(tiny_moe):
    return run_helper("moe_routes.py", tiny_moe, "bfloat16", "near-tie", timeout=600)


@pytest.mark.slow
def test_vllm_records_a_route_for_every_computed_position(fp32):
    # seen from the trainer: its routers found a recorded route (not -1) at every position it
    # computes, prompt + response - 1 per sample (the rollout's own count is checked on capture)
    assert fp32["own_sums"]["recorded_tokens"] == sum(fp32["expected"])
    assert fp32["own_sums"]["decisions"] == sum(fp32["expected"]) * fp32["layers"]
    assert fp32["partial_positions"] == fp32["partial_expected"]  # a continuation routes its whole context
    assert fp32["same_prompt_routes"]
    # each batch starts from no tables (an unfinished request's would pile up otherwise)
    assert fp32["tables_planted"] == ["stale"] and fp32["tables_after_batch"] == []


@pytest.mark.slow
def test_in_float32_vllm_and_the_trainer_agree_and_replay_changes_nothing(fp32):
    assert fp32["metrics"]["router_agreement"] == 1.0 and fp32["metrics"]["routes_differ_tokens"] == 0.0
    # float32 HF vs vLLM, the mean |diff| over tokens (not the max), ~1e-6
    assert fp32["mismatch_own"] < 1e-5 and fp32["mismatch_replay"] < 1e-5
    # float32 HF forwards: block-by-block replay / packed layout vs padded, max |diff|: test_packing sees 8.6e-6
    # here, 0.86 of a 1e-5 bound; 3e-5 leaves other CPUs' kernels room (a wrong route or mask is off by > 1e-2)
    assert fp32["replay_vs_reference_max"] < 3e-5 and fp32["packed_vs_padded_max"] < 3e-5


@pytest.mark.slow
def test_replaying_bf16_routes_brings_the_trainer_closer_to_vllm(bf16):
    m = bf16["metrics"]
    assert m["router_agreement"] < 1.0 and m["routes_differ_tokens"] > 0.0  # otherwise the test shows nothing
    s = bf16["own_sums"]
    # a ratio of integer counts, at most one float32 rounding (6e-8) vs approx's default rel 1e-6
    assert m["router_agreement"] == pytest.approx(s["agree"] / s["decisions"])
    assert bf16["mismatch_replay"] < bf16["mismatch_own"]
    # the trainer side is float32 in the bf16 run too (only vLLM is bf16): as the float32 check above
    assert bf16["replay_vs_reference_max"] < 3e-5 and bf16["packed_vs_padded_max"] < 3e-5
