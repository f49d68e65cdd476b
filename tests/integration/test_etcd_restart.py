"""Restart the etcd process during a run: the ranks retry the lost etcd with backoff and ride
it out; the run finishes, every iteration is logged once and every checkpoint is loadable."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spmd_rl.dock.etcd_server import EmbeddedEtcd
from spmd_rl.trainer.checkpoint import complete_checkpoints, model_weights
from tests.conftest import REPO, subprocess_env

ITERS = 15


def _flags(etcd: EmbeddedEtcd) -> list[str]:
    return Path(f"/proc/{etcd.proc.pid}/cmdline").read_bytes().decode().split("\0")


def test_only_an_etcd_whose_folder_dies_with_it_skips_fsync(tmp_path):
    """A data folder of its own (deleted at stop) is written without fsync: nothing in it can
    outlive the object, and the tests' and the local launcher's etcd then cost no disk flushes.
    A folder the caller gives may be reused by a restart (above), so it keeps etcd's fsync."""
    with EmbeddedEtcd() as own:
        assert "--unsafe-no-fsync" in _flags(own)
    with EmbeddedEtcd(data_dir=str(tmp_path)) as kept:
        assert "--unsafe-no-fsync" not in _flags(kept) and kept.data_dir in _flags(kept)


@pytest.mark.slow
def test_etcd_restart_mid_run(tiny_model, tmp_path):
    data_dir = tmp_path / "etcd-data"
    data_dir.mkdir()
    etcd = EmbeddedEtcd(data_dir=str(data_dir)).start()
    port = etcd.client_port
    env = subprocess_env() | {"SPMD_RL_ETCD": etcd.endpoint, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "spmd_rl.cli",
        "train",
        "configs/quickstart.yaml",
        f"trainer.iterations={ITERS}",
        "data.global_batch_size=8",
        "rollout.n=4",
        "actor.mini_batch_size=8",
        "actor.micro_batch_size=8",
        f"checkpoint.dir={tmp_path}/ckpt",
        "checkpoint.interval=5",
        "checkpoint.keep=10",
        f"logging.dir={tmp_path}/logs",
        "logging.progress=false",
        "dock.port=0",
        "metadata.retry_s=60",
        "elastic.heartbeat_ttl_s=20",
    ]
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    metrics = tmp_path / "logs/metrics.jsonl"
    try:
        t0 = time.monotonic()
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() - t0 < 300, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.05)
        etcd.stop()  # the data dir is ours, so it survives the stop
        time.sleep(3)
        etcd = EmbeddedEtcd(client_port=port, data_dir=str(data_dir)).start()
        assert proc.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        etcd.stop()
    iters = [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()]
    assert iters == list(range(ITERS))  # rode it out: no restart, nothing repeated or skipped
    ckpts = complete_checkpoints(tmp_path / "ckpt")
    assert [c.name for c in ckpts] == [f"iter_{k:06d}" for k in range(5, ITERS + 1, 5)]
    for c in ckpts:  # no corrupted checkpoint
        weights = model_weights(c)
        assert all(torch.isfinite(w).all() for w in weights.values())
