"""The process group of a device run also serves CPU tensors: the backend string the trainer
uses off CPU, built here on CPU with its host half, carries the metrics collectives."""

from __future__ import annotations

import torch.distributed as dist

from spmd_rl.distributed.accelerator import Accelerator
from spmd_rl.trainer.metrics import global_max, global_maxes, global_sums


def test_device_backends_include_a_cpu_backend():
    assert Accelerator("cuda").backend == "cpu:gloo,cuda:nccl"
    assert Accelerator("npu").backend == "cpu:gloo,npu:hccl"
    assert Accelerator("cpu").backend == "gloo"


def test_metrics_collectives_on_a_group_built_like_the_device_one():
    host_half = Accelerator("cuda").backend.split(",")[0]  # "cpu:gloo": the part CPU tensors use
    dist.init_process_group(host_half, store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert global_sums({"a": 1.5, "b": 2.0}) == {"a": 1.5, "b": 2.0}
        assert global_max(3.0) == 3.0
        # maxima and minima in one collective; a minimum comes back with its own sign
        assert global_maxes({"m": 2.0, "a": -1.0}, mins={"g": 0.25}) == {"m": 2.0, "a": -1.0, "g": 0.25}
    finally:
        dist.destroy_process_group()
