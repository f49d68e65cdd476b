"""One all-gather per bucket (``engines.fsdp.bucket_gather``): the shard layout it assumes is
torch.chunk's, the plan covers every tensor once in order within half the bound, and under a
real 2-rank torchrun (FSDP and TP) the gathered tensors equal ``full_tensor()`` cast to the
generation dtype bit for bit, with one collective per bucket and the live bytes the gather
allocates (counted from outside, ``tools/memory_probe``) within ``in_flight``."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.conftest import REPO


def test_chunk_len_is_torch_chunk():
    from spmd_rl.engines.fsdp.bucket_gather import chunk_len

    for n in range(0, 40):
        for parts in range(1, 9):
            got = [chunk_len(n, parts, i) for i in range(parts)]
            want = [len(c) for c in torch.arange(n).chunk(parts)] if n else []
            assert got == want + [0] * (parts - len(want)), (n, parts)


def test_plan_covers_every_tensor_once_within_half_the_bound(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from spmd_rl.engines.fsdp.bucket_gather import in_flight, plan

    mesh = init_device_mesh("cpu", (1,))
    shapes = [(272, 128), (128,), (384, 128), (128, 384), (3, 5), (1000, 64), (7,)]
    named = [(f"t{k}", distribute_tensor(torch.randn(s), mesh, [Shard(0)])) for k, s in enumerate(shapes)]
    named.insert(3, ("plain", torch.randn(4, 4)))
    limit = 600 << 10
    buckets = plan(named, 2, limit)
    assert [p.name for b in buckets for p in b.pieces] == [n for n, _ in named]
    for b in buckets:
        assert len(b.pieces) == 1 or b.temp_elems() * 2 <= limit / 2
        assert [p.offset for p in b.pieces] == [sum(q.padded for q in b.pieces[:k]) for k in range(len(b.pieces))]
    assert any(len(b.pieces) > 1 for b in buckets)
    lone = max(b.temp_elems() * 2 for b in buckets if len(b.pieces) == 1)
    assert max(in_flight(buckets, 2)) <= max(limit, 2 * lone)


def _run(tmp_path, model, dp: int, tp: int, dtype: str, bucket: int) -> list[dict]:
    sys.path.insert(0, str(REPO / "tools"))
    from bench_gather import launch

    return launch(model, tmp_path, dp, tp, dtype, bucket, 1)


@pytest.mark.slow
def test_one_all_gather_per_bucket_bit_exact_and_within_its_bound(tmp_path, tiny_model):
    for dp, tp, dtype, limit in ((2, 1, "bfloat16", 512 << 10), (1, 2, "float32", 2 << 20)):
        for r in _run(tmp_path, tiny_model, dp, tp, dtype, limit):
            new, old = r["per_bucket"], r["per_parameter"]
            assert new["exact"] and old["exact"], (dp, tp)  # every tensor == full_tensor() cast, by digest
            assert new["peak_live"] <= r["bound"] <= limit, (dp, tp, new["peak_live"], r["bound"])
            if dp == 2:
                assert old["collectives"] == r["params"]  # the counter sees every per-parameter gather
                assert new["collectives"] == r["buckets"] < r["params"] // 3
