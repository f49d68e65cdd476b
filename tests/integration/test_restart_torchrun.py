"""Harder to kill, on one node of 2 ranks (deterministic runs, compared with an uninterrupted
one):

- SIGKILL one worker of a run started with ``checkpoint.resume=<folder>``: torchrun restarts
  the group, the new workers resume from the run's newest checkpoint (not the folder it was
  started from), redo the interrupted iteration, log each iteration once, and the final
  weights equal the uninterrupted run's.
- Stop rank 0's warehouse server thread while the rank lives (tests/helpers/faults): every
  rank sees the warehouse's liveness key withdrawn and exits, torchrun restarts the group,
  and the run ends with the same final weights; the log shows when the loss was detected."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spmd_rl.trainer.checkpoint import model_weights

from tests.conftest import REPO, subprocess_env
from tests.torchrun_util import kill_tree, workers_of

ITERS = 4


def command(tmp: Path, name: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "spmd_rl.cli",
        "train",
        "configs/quickstart.yaml",
        f"checkpoint.dir={tmp / name}/ckpt",
        f"logging.dir={tmp / name}/logs",
        f"trainer.iterations={ITERS}",
        "data.global_batch_size=8",
        "rollout.n=4",
        "actor.mini_batch_size=8",
        "actor.micro_batch_size=8",
        "trainer.deterministic=true",
        "checkpoint.interval=1",
        "checkpoint.keep=10",
        f"metadata.job=r-{name}",
        "dock.port=0",
        "logging.progress=false",
        "elastic.max_restarts=2",
        *extra,
    ]


def env() -> dict[str, str]:
    return subprocess_env() | {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def clean(tiny_model, tmp_path_factory) -> Path:
    """The uninterrupted run every fault is compared with."""
    return clean_run(tmp_path_factory.mktemp("restart"))


def final_weights(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    return model_weights(tmp / name / f"ckpt/iter_{ITERS:06d}")


def clean_run(tmp: Path, *extra: str) -> Path:
    """An uninterrupted run every fault is compared with."""
    ref = subprocess.run(
        command(tmp, "clean", *extra), cwd=REPO, env=env(), capture_output=True, text=True, timeout=600
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    return tmp


def killed_run_equals_clean(clean: Path, tmp_path: Path, *extra: str) -> None:
    """SIGKILL one worker of a run started from the clean run's first checkpoint once it has
    written its second: the group restarts from its own newest checkpoint, logs every iteration
    once, and ends with the clean run's weights and samples."""
    log = open(tmp_path / "killed.log", "w")
    start = clean / "clean/ckpt/iter_000001"
    proc = subprocess.Popen(
        command(tmp_path, "killed", f"checkpoint.resume={start}", *extra),
        cwd=REPO,
        env=env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    metrics = tmp_path / "killed/logs/metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if (
                metrics.exists()
                and len(metrics.read_text().splitlines()) >= 2
                and (tmp_path / "killed/ckpt/iter_000002").is_dir()
            ):
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
    finally:
        kill_tree(proc)
        log.close()
    text = (tmp_path / "killed.log").read_text()
    resumed = [line.split("resumed from ")[1].split()[0] for line in text.splitlines() if "resumed from " in line]
    assert resumed[0] == str(start), resumed
    assert len(resumed) >= 2 and Path(resumed[-1]).parent == tmp_path / "killed/ckpt", (
        resumed
    )  # not rolled back to the folder
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    iters = [r["iteration"] for r in rows]
    assert iters == list(range(1, ITERS))  # each iteration logged exactly once, none skipped
    for rank in range(2):  # and traced once on every rank: the restart dropped the spans of the iterations it redid
        traced = [
            json.loads(line)["iteration"]
            for line in (tmp_path / f"killed/logs/trace/rank{rank}.jsonl").read_text().splitlines()
        ]
        assert traced == list(range(1, ITERS)), (rank, traced)
    a, b = final_weights(clean, "clean"), final_weights(tmp_path, "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    clean_rows = [json.loads(line) for line in (clean / "clean/logs/metrics.jsonl").read_text().splitlines()]
    last_by_iter = {r["iteration"]: r["reward_mean"] for r in rows}
    assert last_by_iter == {r["iteration"]: r["reward_mean"] for r in clean_rows if r["iteration"] >= 1}  # same samples
    assert recovered is not None, "no iteration was logged after the kill"
    print(f"recovery: kill -> next iteration logged in {recovered:.1f} s; iterations logged {iters}")


@pytest.mark.slow
def test_killed_worker_is_restarted_and_nothing_is_lost(clean, tmp_path):
    killed_run_equals_clean(clean, tmp_path)


MEGATRON = (
    "actor.backend=megatron",
    "parallel.train.tp=2",
    "parallel.train.dp_shard=1",
    "parallel.train.sequence_parallel=true",
)


@pytest.mark.slow
def test_killed_worker_recovers_under_the_megatron_backend(tiny_model, tmp_path):
    """The same kill under megatron-core TP 2 + SP: its checkpoints (HF-named DCP, AdamW
    moments and step) restore the run exactly, so the final weights equal an uninterrupted run's."""
    clean = clean_run(tmp_path / "ref", *MEGATRON)
    (tmp_path / "kill").mkdir()
    killed_run_equals_clean(clean, tmp_path / "kill", *MEGATRON)


STAMP = re.compile(r"^\[rank(\d+)\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ERROR .*warehouse of node 0 .*lost")


@pytest.mark.slow
def test_stopped_warehouse_thread_restarts_the_job_with_the_same_result(clean, tmp_path):
    faults = tmp_path / "faults"
    faults.mkdir()
    plan = {"kind": "stop_warehouse", "iteration": 2, "dir": str(faults)}
    fault_env = env() | {"SPMD_RL_TEST_FAULTS": json.dumps(plan)}
    out = subprocess.run(
        command(tmp_path, "stopped"), cwd=REPO, env=fault_env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert (faults / "stopped").exists(), "the fault never fired"
    stopped = float((faults / "stopped").read_text())
    detected = [
        datetime.datetime.strptime(m.group(2), "%Y-%m-%d %H:%M:%S,%f").timestamp() - stopped
        for line in out.stderr.splitlines()
        if (m := STAMP.match(line))
    ]
    assert detected, "no rank logged the lost warehouse:\n" + out.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "stopped/logs/metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(ITERS))
    a, b = final_weights(clean, "clean"), final_weights(tmp_path, "stopped")
    assert all(torch.equal(a[k], b[k]) for k in a)
    print(f"warehouse thread stopped -> loss detected and logged after {min(detected):.1f}-{max(detected):.1f} s")
