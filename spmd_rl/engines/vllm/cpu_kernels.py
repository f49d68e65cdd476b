"""vLLM's CPU kernel fallbacks, registered once per process.

Without Triton, vLLM's CPU platform replaces its Triton kernels with C++ fallbacks
(``CpuPlatform.register_triton_kernel_overrides``) at every worker init, and each time scans the
namespace of every loaded module for references to rebind: about 0.35 M identity checks, 0.6 s of
CPU with a rank's imports (2-core AMD EPYC, vLLM 0.32), so 1.2 s of every two-rank job. Once per
process is enough: the registration also swaps each kernel's defining attribute, so a module
imported later gets the fallback. ``register_once`` makes the platform's hook run once and runs
it now; a preload server that calls it (``module:function`` in its list) pays it once for every
rank it forks, and the engine calls it before building (a no-op after the first).
"""

from __future__ import annotations

from spmd_rl.engines.vllm import compat


def register_once() -> None:
    """Make ``CpuPlatform.register_triton_kernel_overrides`` idempotent in this process and run it
    (elsewhere than on vLLM's CPU platform: nothing)."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if platform.__name__ != "CpuPlatform" or getattr(platform, "_spmd_rl_registered_once", False):
        return
    register, done = compat.kernel_override_hook(platform), []
    if register is None:
        return

    def once(cls) -> None:
        if not done:
            register()
            done.append(True)

    platform.register_triton_kernel_overrides = classmethod(once)
    platform._spmd_rl_registered_once = True
    platform.register_triton_kernel_overrides()
