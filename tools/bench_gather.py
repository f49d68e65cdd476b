"""The reshard gather: one all-gather per bucket (``engines.fsdp.bucket_gather``, what the resharder
runs) against one ``full_tensor()`` per parameter (the previous path), in the same run.

    python tools/bench_gather.py [--out runs/bench-gather] [--nproc 2] [--bucket-mib 16] [--dtype bfloat16]

builds a random ~100M-parameter Qwen2 (fp32) unless the folder exists, shards it with FSDP over
``--nproc`` ranks (torchrun, one node) and, per path, prints the best gather time over
``--rounds``, the all-gathers issued and the peak RSS growth of one gather (VmHWM reset through
/proc/self/clear_refs), with the ratios new / old, and for the new path the peak live tensor
bytes (``tools/memory_probe``; it cannot see inside a DTensor op, so it is not used for the old
path) against ``bucket_gather.in_flight``. Under torchrun (RANK set) this file is the
worker, also used by tests/integration/test_bucket_gather.py; worker env: MODEL, TRAIN_DP, TRAIN_TP, DTYPE,
BUCKET_BYTES, ROUNDS, SPMD_RL_OUT. Every gathered tensor's digest is compared with
``full_tensor()`` cast to the generation dtype.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sharded_load import hundred_m_model, run_workers  # noqa: E402
from memory_probe import LiveBytes, reset_peak_rss, status_kib  # noqa: E402

from spmd_rl.config.layout import Layout  # noqa: E402
from spmd_rl.distributed.accelerator import detect  # noqa: E402
from spmd_rl.distributed.mesh import train_mesh  # noqa: E402
from spmd_rl.distributed.teardown import exit_after  # noqa: E402
from spmd_rl.engines.training.hf_weights import build_sharded  # noqa: E402
from spmd_rl.engines.fsdp.parallelize import parallelize  # noqa: E402
from spmd_rl.engines.fsdp import bucket_gather  # noqa: E402


def per_parameter(named, dtype: torch.dtype, limit: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The baseline: each shard cast, then ``full_tensor()`` per parameter, full tensors held
    per bucket of at most ``limit`` bytes (or one tensor)."""
    bucket, size = [], 0
    for name, p in named:
        n = p.numel() * dtype.itemsize
        if bucket and size + n > limit:
            yield from bucket
            bucket, size = [], 0
        bucket.append((name, p.detach().to(dtype).full_tensor()))
        size += n
    yield from bucket


def per_bucket(named, dtype: torch.dtype, limit: int) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in bucket_gather.plan(named, dtype.itemsize, limit):
        yield from bucket_gather.gather(bucket, dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()  # the buffer itself, no copy


def worker() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    acc = detect("cpu")
    mesh = train_mesh(acc, Layout(int(os.environ["TRAIN_DP"]), int(os.environ["TRAIN_TP"])))
    model = build_sharded(os.environ["MODEL"], torch.float32, acc.device, lambda m: parallelize(m, mesh))
    dtype, limit = getattr(torch, os.environ["DTYPE"]), int(os.environ["BUCKET_BYTES"])
    named = list(model.named_parameters())
    want = {n: digest(p.full_tensor().to(dtype)) for n, p in named}
    plan = bucket_gather.plan(named, dtype.itemsize, limit)
    report = {
        "rank": rank,
        "params": len(named),
        "buckets": len(plan),
        "bound": max(bucket_gather.in_flight(plan, dtype.itemsize)),
    }
    for path, gather in (("per_parameter", per_parameter), ("per_bucket", per_bucket)):
        exact, it = True, gather(named, dtype, limit)
        dist.barrier()
        rss = reset_peak_rss()
        with LiveBytes() as live:
            while (
                item := next(it, None)
            ) is not None:  # a `for` loop would hold the last tensor while the next is gathered
                exact &= digest(item[1]) == want[item[0]]
                del item
        rss_growth = (status_kib("VmHWM") - rss) << 10
        times = []
        for _ in range(int(os.environ.get("ROUNDS", "1"))):
            dist.barrier()
            t0 = time.perf_counter()
            for _name, t in gather(named, dtype, limit):
                del t
            times.append(time.perf_counter() - t0)
        report[path] = {
            "exact": exact,
            "collectives": live.collectives,
            "peak_live": live.peak,
            "peak_rss_growth": rss_growth,
            "seconds": min(times),
        }
    Path(os.environ["SPMD_RL_OUT"], f"gather-rank{rank}.json").write_text(json.dumps(report))


def launch(model: Path, out: Path, dp: int, tp: int, dtype: str, bucket_bytes: int, rounds: int) -> list[dict]:
    """Run the worker under torchrun (one node, dp * tp ranks); the ranks' reports."""
    env = {
        "MODEL": str(model),
        "SPMD_RL_OUT": str(out),
        "TRAIN_DP": str(dp),
        "TRAIN_TP": str(tp),
        "DTYPE": dtype,
        "BUCKET_BYTES": str(bucket_bytes),
        "ROUNDS": str(rounds),
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }  # large blocks go back to the kernel when freed: RSS follows live bytes
    run_workers(__file__, dp * tp, env, "gather benchmark")
    return [json.loads((out / f"gather-rank{r}.json").read_text()) for r in range(dp * tp)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/bench-gather"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--bucket-mib", type=float, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    full, _ = hundred_m_model(args.out / "m100")
    reports = launch(args.out / "m100", args.out, args.nproc, 1, args.dtype, int(args.bucket_mib * 2**20), args.rounds)
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    r = max(reports, key=lambda r: r["per_bucket"]["seconds"])
    print(
        f"model {mib(full)} fp32, {r['params']} parameters, {args.nproc} ranks (FSDP), gather in {args.dtype}, "
        f"bucket {args.bucket_mib:g} MiB -> {r['buckets']} buckets, temporary bound {mib(r['bound'])}"
    )
    for path in ("per_parameter", "per_bucket"):
        x = r[path]
        print(
            f"  {path:14s} {x['seconds']:.3f} s  {x['collectives']:4d} all-gathers  peak RSS growth "
            f"{mib(x['peak_rss_growth'])}  "
            f"exact {all(q[path]['exact'] for q in reports)}"
        )
    old, new = r["per_parameter"], r["per_bucket"]
    print(
        f"  per_bucket live tensor bytes (tools/memory_probe) peak {mib(new['peak_live'])} within the bound "
        f"{mib(r['bound'])}: "
        f"{new['peak_live'] <= r['bound']}"
    )
    print(
        f"  ratios per_bucket / per_parameter: time {new['seconds'] / old['seconds']:.2f}, "
        f"peak RSS growth {new['peak_rss_growth'] / max(1, old['peak_rss_growth']):.2f}"
    )


if __name__ == "__main__":
    exit_after(worker) if "RANK" in os.environ else main()
