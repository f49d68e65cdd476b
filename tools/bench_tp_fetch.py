#!/usr/bin/env python
"""Within a DP group, which is cheaper for TP peers to get the group's share of samples:
(a) every TP rank fetches its own copy from the warehouse, or (b) the DP leader fetches once
and broadcasts to its TP peers over the process group? Measured in the same run.

    torchrun --nproc-per-node 2 tools/bench_tp_fetch.py --mib 64
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from spmd_rl.distributed.teardown import exit_after
from spmd_rl.dock.store import flatten, unflatten
from spmd_rl.dock.warehouse import WarehouseServer
from spmd_rl.dock.warehouse_client import WarehouseClient

TOKEN = "bench-tp-fetch-token-0123456789"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=64, help="Bytes of the share, in MiB.")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per = int(args.mib * 2**20 / 4 / args.samples)
    idx = list(range(args.samples))
    server = None
    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        server = WarehouseServer("127.0.0.1", 0, TOKEN, bucket_bytes=64 << 20).start()
        writer = WarehouseClient(server.address, TOKEN)
        writer.put(0, idx, {"x": [torch.randn(per) for _ in idx]}, {"x": True})
        writer.close()
        port[0] = server.port
    dist.broadcast(port, 0)
    client = WarehouseClient(f"tcp://127.0.0.1:{int(port)}", TOKEN)

    def own_copy():
        return client.get(0, idx, ["x"])["x"]

    def leader_broadcast():
        if rank == 0:
            flat, lengths = flatten(client.get(0, idx, ["x"])["x"], True)
            meta = torch.tensor([flat.numel()] + lengths, dtype=torch.int64)
        else:
            meta = torch.zeros(1 + len(idx), dtype=torch.int64)
        dist.broadcast(meta, 0)
        if rank != 0:
            flat = torch.empty(int(meta[0]))
        dist.broadcast(flat, 0)
        return unflatten(flat, len(idx), meta[1:].tolist())

    results = {}
    for name, fn in (("each rank fetches", own_copy), ("leader fetches + broadcast", leader_broadcast)):
        best = float("inf")
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            best = min(best, time.perf_counter() - t0)
        results[name] = best
    if rank == 0:
        mib = per * 4 * len(idx) / 2**20
        print(f"{world} TP ranks, share {mib:.1f} MiB in {len(idx)} samples")
        for name, t in results.items():
            print(f"  {name:28s} {t * 1000:8.1f} ms")
        a, b = results.values()
        print(f"  ratio broadcast / own copy: {b / a:.2f}", flush=True)
    dist.barrier()
    client.close()
    if server is not None:
        server.stop()


if __name__ == "__main__":
    exit_after(main)
