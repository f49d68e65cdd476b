"""The rollout engine reads its RolloutConfig fields, device-only ones included: the options
it hands to vLLM are built by pure functions, checked here on CPU for every device kind."""

from __future__ import annotations

import os

from vllm import SamplingParams

from spmd_rl.config.schema import RolloutConfig
from spmd_rl.engines.rollout import configure_vllm_env, engine_options, sampling_options


def test_engine_options_per_device_kind():
    cfg = RolloutConfig(n=2, max_response_length=4, gpu_memory_utilization=0.3, enforce_eager=False)
    gpu = engine_options("cuda", cfg, distributed=True)
    assert gpu["gpu_memory_utilization"] == 0.3 and gpu["enable_sleep_mode"] and gpu["enforce_eager"] is False
    assert gpu["distributed_executor_backend"] == "external_launcher"
    assert engine_options("npu", cfg, distributed=False)["gpu_memory_utilization"] == 0.3
    cpu = engine_options("cpu", RolloutConfig(n=2, max_response_length=4), distributed=False)
    assert "gpu_memory_utilization" not in cpu and "enable_sleep_mode" not in cpu and cpu["enforce_eager"] is True
    assert cpu["logprobs_mode"] == "processed_logprobs"  # log-probs of the distribution that was sampled


def test_sampling_options_apply_top_p_top_k_when_sampling():
    cfg = RolloutConfig(n=2, max_response_length=4, top_p=0.9, top_k=20)
    params = SamplingParams(**sampling_options(cfg, 0.7, n=2, max_tokens=4, seed=3))
    assert (params.top_p, params.top_k, params.temperature, params.n, params.seed) == (0.9, 20, 0.7, 2, 3)
    greedy = sampling_options(cfg, 0.0, n=1, max_tokens=4, seed=None)
    assert (greedy["top_p"], greedy["top_k"]) == (1.0, -1)


def test_kv_cache_size_reaches_vllm(monkeypatch):
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    configure_vllm_env(RolloutConfig(n=2, max_response_length=4, kv_cache_gib=3))
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
