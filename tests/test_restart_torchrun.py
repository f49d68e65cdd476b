"""Harder to kill: SIGKILL one worker in the middle of a 2-rank run that was started with
``checkpoint.resume=<folder>``; torchrun restarts the group, the new workers resume from the
run's newest checkpoint (not the folder it was started from), redo the interrupted iteration,
log each iteration once, and the final weights equal an uninterrupted run's (deterministic)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spmd_rl.trainer.checkpoint import model_weights

from tests.conftest import REPO, subprocess_env
from tests.torchrun_util import descendants

ITERS = 4


def command(tmp: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "spmd_rl.cli", "train", "configs/quickstart.yaml",
            f"checkpoint.dir={tmp / name}/ckpt", f"logging.dir={tmp / name}/logs", f"trainer.iterations={ITERS}",
            "data.global_batch_size=8", "rollout.n=4", "actor.mini_batch_size=8", "actor.micro_batch_size=8",
            "trainer.deterministic=true", "checkpoint.interval=1", "checkpoint.keep=10", f"metadata.job=r-{name}",
            "dock.port=0", "logging.progress=false", "elastic.max_restarts=2", *extra]


def env() -> dict[str, str]:
    return subprocess_env() | {"OMP_NUM_THREADS": "1"}


def final_weights(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    return model_weights(tmp / name / f"ckpt/iter_{ITERS:06d}")


def workers_of(pid: int) -> list[int]:
    """Worker processes (python -m spmd_rl.train) below the launcher ``pid``."""
    return [p for p, args in descendants(pid) if "spmd_rl.train" in args and "torch.distributed.run" not in args]


@pytest.mark.slow
def test_killed_worker_is_restarted_and_nothing_is_lost(tiny_model, tmp_path):
    ref = subprocess.run(command(tmp_path, "clean"), cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]

    log = open(tmp_path / "killed.log", "w")
    start = tmp_path / "clean/ckpt/iter_000001"
    proc = subprocess.Popen(command(tmp_path, "killed", f"checkpoint.resume={start}"), cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT)
    metrics = tmp_path / "killed/logs/metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2 and (tmp_path / "killed/ckpt/iter_000002").is_dir():
                break
            time.sleep(0.05)
        victims = workers_of(proc.pid)
        assert victims, "no worker found to kill"
        killed_at = time.monotonic()
        os.kill(victims[-1], signal.SIGKILL)
        seen = len(metrics.read_text().splitlines())
        recovered = None
        while proc.poll() is None and time.monotonic() < deadline:
            if recovered is None and len(metrics.read_text().splitlines()) > seen:
                recovered = time.monotonic() - killed_at
            time.sleep(0.05)
        assert proc.wait(timeout=60) == 0, (tmp_path / "killed.log").read_text()[-4000:]
    finally:  # never leave the launcher or its workers behind
        for pid, _ in descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "killed.log").read_text()
    resumed = [line.split("resumed from ")[1].split()[0] for line in text.splitlines() if "resumed from " in line]
    assert resumed[0] == str(start), resumed
    assert len(resumed) >= 2 and Path(resumed[-1]).parent == tmp_path / "killed/ckpt", resumed  # not rolled back to the folder
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    iters = [r["iteration"] for r in rows]
    assert iters == list(range(1, ITERS))  # each iteration logged exactly once, none skipped
    a, b = final_weights(tmp_path, "clean"), final_weights(tmp_path, "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    clean_rows = [json.loads(line) for line in (tmp_path / "clean/logs/metrics.jsonl").read_text().splitlines()]
    last_by_iter = {r["iteration"]: r["reward_mean"] for r in rows}
    assert last_by_iter == {r["iteration"]: r["reward_mean"] for r in clean_rows if r["iteration"] >= 1}  # same samples
    assert recovered is not None, "no iteration was logged after the kill"
    print(f"recovery: kill -> next iteration logged in {recovered:.1f} s; iterations logged {iters}")
