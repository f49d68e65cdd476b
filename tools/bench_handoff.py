#!/usr/bin/env python
"""The separated generator's weight handoff to its engine process: the update written as one
safetensors file and read back (what ``load_weights_file`` does), under ``TMPDIR`` (the previous
path) against ``/dev/shm`` (``engines.vllm.handoff``), rounds alternating (issue 70, finding 8).

Prints the median seconds to write and to read each update, and the bytes this process sent to
the block layer (``/proc/self/io`` ``write_bytes``: what reaches a disk, flushed by the end of
each round).

    python tools/bench_handoff.py --params-m 250 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from spmd_rl.engines.vllm import weight_file


def disk_bytes() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def one(folder: Path, meta, tensors) -> tuple[float, float, int]:
    path = folder / "weights.safetensors"
    before = disk_bytes()
    t0 = time.perf_counter()
    weight_file.write(str(path), meta, iter(tensors))
    t1 = time.perf_counter()
    with safe_open(str(path), framework="pt") as f:
        total = sum(int(f.get_tensor(n).sum()) for n in f.keys())
    t2 = time.perf_counter()
    os.sync()  # what the write left in the page cache reaches the disk before it is counted
    written = disk_bytes() - before
    path.unlink()
    assert total is not None
    return t1 - t0, t2 - t1, written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-m", type=float, default=250.0, help="million bf16 parameters per update")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    per = int(args.params_m * 1e6) // 64
    tensors = [(f"w{k}", torch.randn(per).bfloat16()) for k in range(64)]
    meta = [(n, t.dtype, list(t.shape)) for n, t in tensors]
    dirs = {"TMPDIR": Path(tempfile.mkdtemp()), "/dev/shm": Path(tempfile.mkdtemp(dir="/dev/shm"))}
    got: dict[str, list[tuple[float, float, int]]] = {k: [] for k in dirs}
    for _ in range(args.rounds):
        for name, folder in dirs.items():
            got[name].append(one(folder, meta, tensors))
    for folder in dirs.values():
        folder.rmdir()
    gib = sum(t.numel() * 2 for _, t in tensors) / 2**30
    print(
        f"{platform.processor() or platform.machine()}: {gib:.2f} GiB per update (bf16), median of {args.rounds} "
        f"rounds, paths alternating; TMPDIR = {tempfile.gettempdir()}"
    )
    print(f"{'path':10s} {'write s':>8s} {'read s':>8s} {'total s':>8s} {'disk MiB/update':>16s}")
    for name, rows in got.items():
        w, r = statistics.median(x[0] for x in rows), statistics.median(x[1] for x in rows)
        disk = statistics.median(x[2] for x in rows) / 2**20
        print(f"{name:10s} {w:8.3f} {r:8.3f} {w + r:8.3f} {disk:16.1f}")


if __name__ == "__main__":
    main()
