"""Fields read by the launcher and the loop's small helpers: torchrun's rendezvous from
``elastic``, the reference micro-batch, and the metrics files from ``logging``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from spmd_rl.config.loader import load_config
from spmd_rl.recipe.graph import ref_micro_batch_size
from spmd_rl.launcher.local import torchrun_command
from spmd_rl.trainer.metrics import MetricsLog
from tests.conftest import REPO


def _cfg(*overrides: str):
    return load_config(REPO / "configs/quickstart.yaml", list(overrides))


def _cmd(*overrides: str) -> list[str]:
    return torchrun_command(Path("c.yaml"), [], _cfg(*overrides), 2)


def test_rendezvous_follows_the_elastic_fields():
    assert "--standalone" in _cmd()
    etcd = _cmd(
        "elastic.rdzv_backend=etcd-v2",
        "elastic.min_nodes=1",
        "elastic.max_nodes=3",
        "parallel.nnodes=2",
        "metadata.endpoints=[10.1.2.3:2379]",
        "metadata.job=run7",
        "elastic.max_restarts=5",
        "elastic.rdzv_last_call_s=7.5",
    )
    assert "--standalone" not in etcd
    assert {
        "--nnodes=1:3",
        "--rdzv-backend=etcd-v2",
        "--rdzv-endpoint=10.1.2.3:2379",
        "--rdzv-id=run7",
        "--max-restarts=5",
        "--rdzv-conf=last_call_timeout=7.5",
    } <= set(etcd)
    tls = _cmd(
        "elastic.rdzv_backend=etcd-v2",
        "elastic.max_nodes=2",
        "metadata.endpoints=[10.1.2.3:2379]",
        "metadata.ca_file=/c/ca.crt",
        "metadata.cert_file=/c/client.crt",
        "metadata.key_file=/c/client.key",
    )
    assert (
        "--rdzv-conf=last_call_timeout=3,protocol=https,ca_cert=/c/ca.crt,ssl_cert=/c/client.crt,ssl_cert_key=/c/client.key"
        in tls
    )
    c10d = _cmd("elastic.max_nodes=2", "elastic.rdzv_endpoint=10.1.2.4:29400")
    assert {"--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.1.2.4:29400"} <= set(c10d)


def test_ref_micro_batch_size_defaults_to_the_actors():
    assert ref_micro_batch_size(_cfg("actor.micro_batch_size=16")) == 16
    assert ref_micro_batch_size(_cfg("actor.micro_batch_size=16", "ref.micro_batch_size=4")) == 4


def test_jsonl_off_writes_no_metrics_file(tmp_path):
    cfg = _cfg("logging.jsonl=false")  # as the driver builds it (trainer.trainer.Trainer.train)
    off = MetricsLog(tmp_path / "off", cfg.logging.jsonl, tensorboard=False, enabled=True)
    off.write(0, {"loss": 1.0})
    off.close()
    assert not (tmp_path / "off/metrics.jsonl").exists()
    on = MetricsLog(tmp_path / "on", jsonl=True, tensorboard=False, enabled=True)
    on.write(0, {"loss": 1.0})
    on.close()
    assert json.loads((tmp_path / "on/metrics.jsonl").read_text()) == {"iteration": 0, "loss": 1.0}


@pytest.mark.parametrize(
    "script,env,want",
    [
        ("single_node.sh", {}, "-m spmd_rl.cli train cfg.yaml a=1"),
        ("multi_node.sh", {"ETCD": "h:1", "TOKEN": "t"}, "-m torch.distributed.run --nnodes=1:2"),
    ],
)
def test_the_launch_scripts_run_the_python_they_are_given(tmp_path, script, env, want):
    """``launch/*.sh`` run ``$PYTHON`` (default python3 on PATH: a venv, conda env or container
    Python), not a fixed ``.venv``."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "ran: $*"\n')
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    for py in ({"PYTHON": str(fake)}, {"PATH": f"{tmp_path}:{os.environ['PATH']}"}):
        if "PATH" in py:
            (tmp_path / "python3").symlink_to(fake)
        res = subprocess.run(
            [str(REPO / "launch" / script), "cfg.yaml", "a=1"], env=base | env | py, capture_output=True, text=True
        )
        assert res.returncode == 0 and f"ran: {want}" in res.stdout, (py, res.stdout, res.stderr)
