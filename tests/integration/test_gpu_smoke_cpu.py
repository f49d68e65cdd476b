"""tools/gpu_smoke.py is the accelerator acceptance run; CI runs it on two CPU ranks through
the same script, so it cannot rot while no device is at hand: bf16, TP 2 in training and
generation, a reference role, vLLM's log-probs within the bf16 bound of the trainer's at
iteration 0 and after updates, allgather-swap holding less than naive by the training state,
and a checkpoint resumed. The script's own exit status carries the checks; a broken check
(here: a mismatch bound no bf16 run meets) must make it fail."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, subprocess_env

SMALL = ["data.global_batch_size=8", "rollout.n=4", "actor.mini_batch_size=8", "dock.port=0"]


@pytest.mark.slow
@pytest.mark.vllm_range
def test_gpu_smoke_script_passes_on_two_cpu_ranks(tiny_model, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "tools/gpu_smoke.py",
            "--device",
            "cpu",
            "--nproc-per-node",
            "2",
            "--out",
            str(tmp_path),
            *SMALL,
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(out.stdout)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "all checks passed" in out.stdout
    rows = {
        line.split()[0]: line.split()
        for line in out.stdout.splitlines()
        if line.split() and line.split()[0] in ("naive", "swap", "resume", "megatron")
    }
    assert (
        set(rows) == {"naive", "swap", "resume", "megatron"} and rows["resume"][1] == "3" and rows["megatron"][1] == "2"
    )


@pytest.mark.slow
def test_gpu_smoke_fails_when_a_check_fails(tiny_model, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "tools/gpu_smoke.py",
            "--device",
            "cpu",
            "--nproc-per-node",
            "1",
            "--mismatch",
            "1e-9",
            "--out",
            str(tmp_path),
            *SMALL,
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 1 and "logprob_mismatch_mean" in out.stderr, out.stderr[-2000:]
