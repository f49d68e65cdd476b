"""Elastic replicas in the trainer (``elastic.replicas``), each replica its own ``spmd-rl train``
(a torchrun job) against one real etcd: three replicas train one global batch; one is
SIGKILLed (launcher, agent and rank) right after its first iteration, during the next one's
generation. The survivors keep their processes (each logs its start once), redo the
interrupted iteration with the prompts dealt over two, train every prompt of every iteration
once (the survivors' samples add up to the global batch) and end bit-identical to each other
and, within float round-off, equal to one job training the same global batch alone: the
objective's split invariance across replicas."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spmd_rl.trainer.checkpoint import model_weights
from tests.conftest import REPO, subprocess_env
from tests.torchrun_util import descendants, kill_tree

ITERS, G, N = 3, 6, 2


def command(tmp: Path, etcd, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "spmd_rl.cli",
        "train",
        "configs/quickstart.yaml",
        f"checkpoint.dir={tmp}/ckpt",
        f"logging.dir={tmp}/logs",
        f"trainer.iterations={ITERS}",
        f"data.global_batch_size={G}",
        f"rollout.n={N}",
        f"actor.mini_batch_size={G}",
        "actor.micro_batch_size=2",
        "parallel.nproc_per_node=1",
        "parallel.train.dp_shard=1",
        "parallel.gen.dp=1",
        "rollout.engine=hf",
        "rollout.max_response_length=8",
        "trainer.deterministic=true",
        "checkpoint.interval=0",
        f"metadata.endpoints=[{etcd.endpoint}]",
        "dock.token=replicas-test-token",
        "logging.progress=false",
        "elastic.max_restarts=0",
        *extra,
    ]


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_survivors_of_a_killed_replica_redo_its_iteration_and_match_one_job(tiny_model, tmp_path, etcd):
    env = subprocess_env() | {"OMP_NUM_THREADS": "1"}
    solo = subprocess.run(
        command(tmp_path / "solo", etcd, "metadata.job=solo"), cwd=REPO, env=env, capture_output=True, text=True
    )
    assert solo.returncode == 0, solo.stderr[-3000:]
    replica = ["metadata.job=elastic", "elastic.replicas.count=3", "elastic.replicas.timeout_s=30"]
    procs = {
        n: subprocess.Popen(
            command(tmp_path / "elastic", etcd, *replica, f"elastic.replicas.name={n}"),
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"{n}.err", "w"),
        )
        for n in "abc"
    }
    seen = []
    try:
        deadline = time.monotonic() + 600
        while not rows(tmp_path / "elastic/logs/c/metrics.jsonl") and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs.values()), [
                (tmp_path / f"{n}.err").read_text()[-2000:] for n in "abc"
            ]
            time.sleep(0.05)
        seen = descendants(procs["c"].pid)
        kill_tree(procs["c"])
        for n in "ab":
            assert procs[n].wait(timeout=600) == 0, (tmp_path / f"{n}.err").read_text()[-3000:]
    finally:
        for p in procs.values():
            kill_tree(p, seen)
    logs = {n: rows(tmp_path / f"elastic/logs/{n}/metrics.jsonl") for n in "ab"}
    for n in "ab":
        assert [r["iteration"] for r in logs[n]] == list(range(ITERS))  # each once: nobody restarted
        assert [r["replicas"] for r in logs[n]] == [3, 2, 2]
        assert logs[n][1]["replica_redone"] == 1  # the iteration c was in when it died
        err = (tmp_path / f"{n}.err").read_text()
        assert err.count("training from iteration") == 1 and "redo it" in err
    for it in range(ITERS):  # every prompt's samples trained once, by the replicas of that iteration
        total = sum(logs[n][it]["samples"] for n in "ab") + (
            rows(tmp_path / "elastic/logs/c/metrics.jsonl")[0]["samples"] if it == 0 else 0
        )
        assert total == G * N, (it, total)
    a, b = (model_weights(tmp_path / f"elastic/ckpt/{n}/iter_{ITERS:06d}") for n in "ab")
    ref = model_weights(tmp_path / f"solo/ckpt/iter_{ITERS:06d}")
    assert all(torch.equal(a[k], b[k]) for k in a)
    start = load_file(Path(tiny_model) / "model.safetensors")
    worst = max(float((a[k].float() - ref[k].float()).abs().max()) for k in ref)
    moved = max(float((ref[k].float() - start[k].float()).abs().max()) for k in ref if k in start)
    print(f"largest difference from the one-job run: {worst:.3g} (the update moved weights by up to {moved:.3g})")
    assert worst <= 1e-6 and moved > 1e-5  # replicas stepping on their own shares would differ by about `moved`
