"""Phase timeouts act on real collectives: two gloo ranks, rank 1 late to a barrier. Under the
steady-state timeout (1 s) rank 0's barrier fails; under the start-up timeout (30 s) the same
lateness is waited out, and ``long_phase`` (checkpoint writes) restores the steady timeout on
exit. ``spmd_rl.train`` runs start-up under ``elastic.startup_timeout_s`` and switches to
``elastic.collective_timeout_s`` once every rank has loaded.

A replica's own group (``train._replica_local_group``: its ranks wait in it while their lead
agrees on a generation, up to ``elastic.startup_timeout_s``) keeps its timeout through the
phases: a multi-rank replica left out of a generation waits for its lead and rejoins instead of
dying on the steady timeout."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spmd_rl.config.loader import load_config
from spmd_rl.distributed.timeouts import generation_phase, long_phase
from tests.conftest import REPO


def _worker(rank: int, init: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    sub = dist.new_group([0, 1])  # like a device-mesh subgroup: created under the initial timeout
    with long_phase(30.0, steady_s=1.0):  # start-up or a checkpoint write
        if rank == 1:
            time.sleep(3)
        dist.barrier(group=sub)
    out[f"long_ok_{rank}"] = True
    try:  # back under the steady 1 s
        if rank == 1:
            time.sleep(4)
        dist.barrier(group=sub)
        out[f"steady_{rank}"] = "ok"
    except RuntimeError as exc:
        out[f"steady_{rank}"] = (
            "timeout" if "timed out" in str(exc).lower() or "timeout" in str(exc).lower() else str(exc)[:200]
        )
    os._exit(0)  # skip destroy: the other rank may be gone


def _two_ranks(worker, tmp_path) -> dict:
    """What ``worker(rank, init, out)`` wrote into ``out`` on two spawned gloo ranks."""
    init = f"file://{tmp_path / 'store'}"  # a file store: no port to race for
    with mp.Manager() as m:
        out = m.dict()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, init, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=90)
        return dict(out)


def test_steady_timeout_fires_and_long_phase_waits(tmp_path):
    got = _two_ranks(_worker, tmp_path)
    assert got.get("long_ok_0") and got.get("long_ok_1"), got  # 3 s late under a 30 s timeout: fine
    assert got.get("steady_0") == "timeout", got  # 4 s late under 1 s: rank 0 gives up


def _replica_worker(rank: int, init: str, out: dict) -> None:
    from spmd_rl.trainer.build import replica_local_group as _replica_local_group

    over = [
        "elastic.replicas.count=2",
        "elastic.replicas.name=a",
        "elastic.collective_timeout_s=1",
        "elastic.startup_timeout_s=30",
    ]
    cfg = load_config(REPO / "configs/quickstart.yaml", over)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    local = _replica_local_group(cfg.elastic)
    with generation_phase(cfg):  # every iteration: the steady 1 s is set on every group after it
        dist.barrier(group=local)
    try:
        if rank == 0:
            time.sleep(3)  # the lead agreeing on a generation
        answer = torch.tensor([7.0 if rank == 0 else 0.0])
        dist.broadcast(answer, group=local, group_src=0)
        out[f"answer_{rank}"] = answer.item()
    except RuntimeError as exc:
        out[f"answer_{rank}"] = str(exc)[:200]
    os._exit(0)


def test_a_replicas_own_group_waits_for_its_lead_past_the_steady_timeout(tmp_path):
    got = _two_ranks(_replica_worker, tmp_path)
    assert got == {"answer_0": 7.0, "answer_1": 7.0}, got  # before: rank 1 timed out after 1 s
