"""The process group of a device run also serves CPU tensors: the backend string the trainer
uses off CPU, built here on CPU with its host half, carries the metrics collectives."""

from __future__ import annotations

import torch.distributed as dist
import torch.multiprocessing as mp

from spmd_rl.distributed.accelerator import Accelerator
from spmd_rl.trainer.metrics import global_max, global_maxes, global_sums


def test_device_backends_include_a_cpu_backend():
    assert Accelerator("cuda").backend == "cpu:gloo,cuda:nccl"
    assert Accelerator("npu").backend == "cpu:gloo,npu:hccl"
    assert Accelerator("cpu").backend == "gloo"


def _rank(rank: int, init: str, out) -> None:
    host_half = Accelerator("cuda").backend.split(",")[0]  # "cpu:gloo": the part CPU tensors use
    dist.init_process_group(host_half, init_method=init, rank=rank, world_size=2)
    try:
        out[rank] = (
            global_sums({"a": 1.5 * (rank + 1), "b": 2.0}, None),
            global_max(3.0 + rank, None),
            # maxima and minima in one collective; a minimum comes back with its own sign
            global_maxes({"m": 2.0 - rank, "a": -1.0 + 3 * rank}, None, mins={"g": 0.25 + rank}),
        )
    finally:
        dist.destroy_process_group()


def test_metrics_collectives_on_a_group_built_like_the_device_one(tmp_path):
    """Two ranks on the host half of a device backend: sums, maxima and minima across ranks,
    the same on both (at world size 1 any reduction, even none, would pass)."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        out = m.dict()
        procs = [ctx.Process(target=_rank, args=(r, f"file://{tmp_path / 'store'}", out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        got = dict(out)
    want = ({"a": 4.5, "b": 4.0}, 4.0, {"m": 2.0, "a": 2.0, "g": 0.25})
    assert got[0] == got[1] == want, got
