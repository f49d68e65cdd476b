"""tools/gpu_smoke.py runs the accelerator path (real trainer, both reshard modes) and is run
on CPU here, through the same script and abstraction, so it cannot rot while no device is at
hand: both modes finish an iteration, and allgather-swap holds less than naive as generation
starts (the ledger's resident bytes; the device allocator's off CPU)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, subprocess_env


@pytest.mark.slow
def test_gpu_smoke_script_runs_on_cpu(tiny_model, tmp_path):
    out = subprocess.run([sys.executable, "tools/gpu_smoke.py", "--device", "cpu", "--iterations", "1", "--out", str(tmp_path),
                          "data.global_batch_size=8", "rollout.n=4", "actor.mini_batch_size=8", "dock.port=0"],
                         cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    print(out.stdout)
    assert "naive" in out.stdout and "allgather_swap" in out.stdout
    saving = float(re.search(r"saving ([0-9.,-]+) MiB", out.stdout).group(1).replace(",", ""))
    assert saving > 0  # the swapped training state (the tiny model's fp32 params and AdamW states)
