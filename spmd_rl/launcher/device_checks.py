"""``spmd-rl doctor``'s checks of a GPU node that would end a first run early (issue 70, finding 6),
each judged from what the run will use, not run on the CPU:

- ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) with ``expandable_segments:True``
  beside vLLM's sleep mode, which every device run of the vLLM engine uses: vLLM's
  ``CuMemAllocator`` refuses expandable segments at start-up;
- a C compiler where Triton must build its launcher: CUDA graphs (``rollout.vllm.enforce_eager:
  false``) and MoE models (vLLM's fused-MoE Triton kernels); Triton looks for ``$CC``, then
  ``cc``, ``gcc``, ``clang`` on the path;
- a driver older than the CUDA that torch was built for: the driver's CUDA major version must
  be at least torch's (``torch.version.cuda``); an older minor works through CUDA's minor-version
  compatibility and is a warning.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping

from spmd_rl.config.model_arch import ModelArch
from spmd_rl.config.schema import Config
from spmd_rl.launcher.check import Check

COMPILERS = ("cc", "gcc", "clang")


def alloc_conf(cfg: Config, kind: str, env: Mapping[str, str] = os.environ) -> Check | None:
    if kind == "cpu" or cfg.rollout.engine != "vllm":
        return None
    name = next((n for n in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if n in env), None)
    conf = env.get(name, "") if name else ""
    bad = "expandable_segments:true" in conf.replace(" ", "").lower()
    return Check(
        "allocator",
        not bad,
        f"{name}={conf}" if name else "PyTorch's allocator settings unset",
        f"unset expandable_segments in {name}: vLLM's sleep mode (CuMemAllocator) refuses it" if bad else "",
    )


def c_compiler(
    cfg: Config,
    arch: ModelArch,
    kind: str,
    env: Mapping[str, str] = os.environ,
    which: Callable[[str], str | None] = shutil.which,
) -> Check | None:
    needs = [
        why
        for why, on in (("CUDA graphs", not cfg.rollout.vllm.enforce_eager), ("fused MoE", arch.num_experts > 0))
        if on
    ]
    if kind == "cpu" or cfg.rollout.engine != "vllm" or not needs:
        return None
    found = next((p for p in ([env["CC"]] if env.get("CC") else []) + [which(c) for c in COMPILERS] if p), None)
    return Check(
        "C compiler",
        found is not None,
        f"{found} for Triton's launcher ({', '.join(needs)})"
        if found
        else f"none, and Triton builds its launcher with one ({', '.join(needs)})",
        "" if found else "install one (apt install gcc) or set CC",
    )


def driver_cuda() -> tuple[int, int] | None:
    """The CUDA version the installed driver supports: torch's own query, else nvidia-smi's header."""
    import torch

    query = getattr(torch._C, "_cuda_getDriverVersion", None)
    if query is not None:
        v = int(query())
        return (v // 1000, v % 1000 // 10) if v else None
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def cuda_driver(kind: str, runtime: str | None, driver: tuple[int, int] | None) -> Check | None:
    """``runtime``: ``torch.version.cuda``; ``driver``: ``driver_cuda()``."""
    if kind != "cuda" or runtime is None:
        return None
    want = tuple(int(x) for x in runtime.split(".")[:2])
    if driver is None:
        return Check(
            "CUDA driver", True, f"its version could not be read; torch is built for CUDA {runtime}", warn=True
        )
    have = f"{driver[0]}.{driver[1]}"
    if driver[0] < want[0]:
        return Check(
            "CUDA driver",
            False,
            f"supports CUDA {have}, torch is built for CUDA {runtime}",
            f"upgrade the NVIDIA driver to one for CUDA {runtime}, or install the torch build for CUDA {have}",
        )
    older = driver < want
    note = " (older minor: CUDA's minor-version compatibility)" if older else ""
    return Check("CUDA driver", True, f"supports CUDA {have}, torch is built for CUDA {runtime}{note}", warn=older)


def device_checks(cfg: Config, arch: ModelArch, kind: str) -> list[Check]:
    """The checks above that apply to this run on a ``kind`` node."""
    import torch

    runtime = torch.version.cuda
    found = [
        alloc_conf(cfg, kind),
        c_compiler(cfg, arch, kind),
        cuda_driver(kind, runtime, driver_cuda() if kind == "cuda" and runtime else None),
    ]
    return [c for c in found if c is not None]
