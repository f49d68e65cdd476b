"""What the rollout engine hands to vLLM: environment, ``LLM(...)`` options and
``SamplingParams``, built by pure functions so every device kind's options are checked on CPU.

Device-only choices and why (vLLM 0.32's CUDA worker; verl's vLLM rollout makes the same ones):

- ``kv_cache_memory_bytes`` = ``rollout.kv_cache_gib``: the KV cache ``plan`` budgets is the one
  vLLM allocates (vLLM otherwise sizes it from ``gpu_memory_utilization`` x total minus what is
  in use at start-up). ``gpu_memory_utilization`` still bounds the start-up check, which the
  rollout engine passes because it is built before every training role. On CPU too: vLLM's
  legacy ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB only (0.25 became 1) and would override the
  option, so ``configure_vllm_env`` removes it. The CPU worker zeroes the whole cache at start
  (1.5 s for 1 GiB here), so a small model's config asks for what it needs.
- ``enable_sleep_mode``: the KV cache (and the weights, ``VllmRollout.sleep``) leave the device
  between rollouts.
- ``disable_custom_all_reduce``: custom all-reduce registers IPC handles of buffers that sleep
  mode's allocator releases and re-maps; with CUDA graphs (``enforce_eager: false``) and TP > 1
  the captured handles go stale after the first sleep.
- ``load_format="dummy"`` for an engine whose first weights come from the actor's gather
  (colocated): no rank reads the checkpoint a second time.

Both kinds: prefix caching on (the N samples of one prompt share its KV blocks; the cache is
reset after every weight load) unless routes are recorded (a cached block is never routed),
no detokenization (the trainer decodes the ids it needs). Routes on a device come from vLLM's
``enable_return_routed_experts`` (Model Runner V2, which needs Triton: not on this CPU);
on the CPU from ``engines.vllm.route_capture``'s hooks on the V1 runner.

``rollout.vllm.enforce_eager`` also keeps vLLM's sampler helpers eager (``eager_sampler``, around the
engine's build and every step): vLLM 0.32 wraps two of them in ``torch.compile`` whatever the
compilation mode, and their first call compiles them (inductor, a C++ build on CPU; 0.26's
CPU worker already calls one in its warm-up, while the engine is built). On CPU that was 4.8 s
of the first generation of every engine, against 0.05-0.08 s for a later one, which eager runs
no slower.

CPU only: no chunked prefill. vLLM discards the token it samples for a partly prefilled request
and rewinds that request's seeded generator by an offset, which CPU generators do not have
("CPU Generator does not use offset"); multi-turn rollouts submit long contexts while other
requests run, which made vLLM chunk them.
"""

from __future__ import annotations

import contextlib
import os

from spmd_rl.config.schema import RolloutConfig

VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def configure_vllm_env(rollout: RolloutConfig, own_process: bool = False) -> None:
    """Environment vLLM reads at import/build time; call before importing vllm."""
    if own_process:  # a fresh (spawned, not forked) engine-core process: no inherited torch world
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the size is engine_options' (module docstring)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts; the engine takes the smallest one >= the adapters' rank."""


def engine_options(
    acc_kind: str,
    cfg: RolloutConfig,
    distributed: bool,
    own_process: bool = False,
    dummy_weights: bool = False,
    record_routes: bool = False,
    expert_parallel: bool = False,
    lora_rank: int | None = None,
) -> dict:
    """vLLM ``LLM(...)`` options from the config (module docstring). ``lora_rank``: serve one
    LoRA adapter of at most this rank (``engines.vllm.adapter_sync``)."""
    if expert_parallel and acc_kind == "cpu":
        raise ValueError(
            "parallel.gen.expert_parallel: vllm-cpu's fused MoE crashes with enable_expert_parallel; set it false on "
            "CPU"
        )
    kw: dict = {
        "enforce_eager": cfg.vllm.enforce_eager,
        "enable_prefix_caching": not record_routes,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": "spmd_rl.engines.vllm.worker.RolloutWorker",
        "use_tqdm_on_load": False,
        "kv_cache_memory_bytes": int(cfg.kv_cache_gib * 2**30),
    }
    if own_process:
        kw["distributed_executor_backend"] = "uni"  # the worker inside the engine-core process
    elif distributed:
        kw["distributed_executor_backend"] = "external_launcher"
    if dummy_weights:
        kw["load_format"] = "dummy"
    if lora_rank is not None:
        kw |= {"enable_lora": True, "max_loras": 1, "max_lora_rank": next(r for r in LORA_RANKS if r >= lora_rank)}
    if acc_kind == "cpu":
        kw["enable_chunked_prefill"] = False  # module docstring
    else:
        kw |= {
            "gpu_memory_utilization": cfg.vllm.gpu_memory_utilization,
            "enable_sleep_mode": True,
            "disable_custom_all_reduce": True,
        }
        # vLLM's own capture (Model Runner V2, CUDA-graph safe); CPU's V1 runner has none (engines.vllm.route_capture)
        if record_routes:
            kw["enable_return_routed_experts"] = True
        if expert_parallel:
            kw["enable_expert_parallel"] = True
    return kw


def sampling_options(  # noqa: PLR0913
    cfg: RolloutConfig, temperature: float, n: int, max_tokens: int, seed: int | None, top_p: float | None = None
) -> dict:
    """``SamplingParams`` of one prompt: top-p (``top_p``, else the config's) and top-k only
    when sampling (temperature > 0)."""
    return {
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": (cfg.top_p if top_p is None else top_p) if temperature > 0 else 1.0,
        "top_k": cfg.top_k if temperature > 0 else -1,
        "logprobs": 0,
        "seed": seed,
        "detokenize": False,
    }


def eager_sampler(cfg: RolloutConfig):
    """Context for an in-process engine's steps: with ``enforce_eager``, every ``torch.compile``
    vLLM reaches runs eagerly (module docstring); the trainer's own compile, outside, is untouched."""
    if not cfg.vllm.enforce_eager:
        return contextlib.nullcontext()
    import torch

    return torch.compiler.set_stance("force_eager")


def eager_child_env(cfg: RolloutConfig) -> dict[str, str]:
    """The same for an engine-core child process, which runs only vLLM: torch.compile off."""
    return {"TORCH_COMPILE_DISABLE": "1"} if cfg.vllm.enforce_eager else {}


def child_device_env(acc_kind: str, local_rank: int, environ: dict[str, str]) -> dict[str, str]:
    """The visible-devices variable an engine-core child process needs to land on this rank's
    device: its ``uni`` executor uses device index 0, so the child must see only device
    ``local_rank`` of the parent's list (the parent's own visible-devices list, when set, maps
    local indices to physical ones). Empty on CPU."""
    name = VISIBLE_DEVICES.get(acc_kind)
    if name is None:
        return {}
    listed = [d for d in environ.get(name, "").split(",") if d.strip()]
    if listed and local_rank >= len(listed):
        raise ValueError(
            f"LOCAL_RANK {local_rank} has no device in {name}={environ[name]!r}: launch at most "
            f"{len(listed)} processes per node or widen {name}"
        )
    return {name: listed[local_rank].strip() if listed else str(local_rank)}
