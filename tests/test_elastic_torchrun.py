"""Elastic: two torchrun agents as two nodes on loopback with etcd-v2 rendezvous (launch/
multi_node.sh) and --nnodes 1:2. Kill one agent entirely: the survivor re-forms a world of 1,
re-derives both layouts, resumes from the latest checkpoint and keeps training; start the
agent again: the world grows back to 2; the run finishes with no iteration skipped."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from spmd_rl.dock.etcd_server import EmbeddedEtcd
from tests.torchrun_util import kill_node, metric_rows, node_agent, wait_for

ITERS = 80


def agent(tmp: Path, etcd: str, name: str) -> subprocess.Popen:
    args = [
        "configs/quickstart.yaml",
        "parallel.train.dp_shard=null",
        "parallel.gen.dp=null",
        "parallel.nnodes=2",
        "parallel.nproc_per_node=1",
        "elastic.min_nodes=1",
        "elastic.max_nodes=2",
        "elastic.heartbeat_ttl_s=3",
        "data.global_batch_size=8",
        "rollout.n=4",
        "actor.mini_batch_size=8",
        "actor.micro_batch_size=8",
        f"trainer.iterations={ITERS}",
        f"checkpoint.dir={tmp}/ckpt",
        "checkpoint.interval=1",
        "checkpoint.keep=3",
        f"logging.dir={tmp}/logs",
        "logging.progress=false",
        "dock.port=0",
        "elastic.collective_timeout_s=20",
    ]
    return node_agent(tmp, etcd, name, args, {"JOB": "elastic-test", "RESTARTS": "5", "LAST_CALL_S": "8"})


def rows(tmp: Path) -> list[dict]:
    return metric_rows(tmp / "logs/metrics.jsonl")


@pytest.mark.slow
def test_node_loss_shrinks_and_rejoin_grows(tiny_model, tmp_path):
    with EmbeddedEtcd() as etcd:
        a = agent(tmp_path, etcd.endpoint, "a")
        b = agent(tmp_path, etcd.endpoint, "b")
        try:
            wait_for(lambda: len(rows(tmp_path)) >= 3, 300, "first iterations with 2 nodes")
            assert rows(tmp_path)[-1]["world"] == 2
            kill_node(b)
            shrink_s = wait_for(
                lambda: any(r["world"] == 1 for r in rows(tmp_path)), 300, "the survivor training alone"
            )
            b = agent(tmp_path, etcd.endpoint, "b2")
            grow_s = wait_for(
                lambda: rows(tmp_path)[-1]["world"] == 2 and any(r["world"] == 1 for r in rows(tmp_path)),
                300,
                "the world growing back to 2",
            )
            assert a.wait(timeout=600) == 0, (tmp_path / "a.log").read_text()[-3000:]
            assert b.wait(timeout=120) == 0, (tmp_path / "b2.log").read_text()[-3000:]
        finally:
            for p in (a, b):
                if p.poll() is None:
                    kill_node(p)
    got = rows(tmp_path)
    assert sorted({r["iteration"] for r in got}) == list(range(ITERS))  # nothing skipped
    worlds = [r["world"] for r in got]
    assert 1 in worlds and worlds[0] == 2 and worlds[-1] == 2
    assert "resumed from" in (tmp_path / "a.log").read_text()
    print(f"kill -> training with world 1 in {shrink_s:.1f} s; rejoin -> world 2 in {grow_s:.1f} s; worlds {worlds}")
