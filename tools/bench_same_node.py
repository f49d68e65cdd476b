#!/usr/bin/env python
"""How a rank reaches its own node's warehouse when it does not serve it: over TCP loopback
(the wire: frames, MAC, socket) vs through shared memory (``dock.same_node``), in the same run,
next to the serving rank's in-process path and a plain memcpy of the same bytes.

A warehouse runs in this process; a second process on this host (a "local rank 1") gets and
puts a share of ``--mib`` MiB in ``--samples`` ragged samples. Medians of ``--repeats``.

    python tools/bench_same_node.py --mib 4 64
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from spmd_rl.dock.host_pool import HostPool  # noqa: E402
from spmd_rl.dock.local import InProcessWarehouse  # noqa: E402
from spmd_rl.dock.same_node import SameNodeWarehouse  # noqa: E402
from spmd_rl.dock.warehouse import WarehouseServer  # noqa: E402
from spmd_rl.dock.warehouse_client import WarehouseClient  # noqa: E402

TOKEN = "bench-same-node-token-0123456789"
POOL = 512 << 20


def timed(fn, repeats: int, after=lambda r: None) -> float:
    """Median seconds of ``fn(r)``; ``after(r)`` runs untimed between repeats."""
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        fn(r)
        times.append(time.perf_counter() - t0)
        after(r)
    return statistics.median(times)


def paths(address: str) -> dict:
    return {"wire": WarehouseClient(address, TOKEN), "shared memory": SameNodeWarehouse(address, TOKEN, POOL)}


def local_rank_1(address: str, samples: int, per: int, repeats: int, out: mp.Queue) -> None:
    """Get iteration 0's share, then put (and drop, as a commit does) fresh iterations, through each path."""
    torch.set_num_threads(1)
    idx, result = list(range(samples)), {}
    for name, client in paths(address).items():
        values = [torch.randn(per) for _ in idx]
        base = 1000 if name == "wire" else 2000

        def get(_):
            got = client.get(0, idx, ["x"])["x"]
            assert got[-1].numel() == per

        put = timed(
            lambda r: client.put(base + r, idx, {"x": values}, {"x": True}),
            repeats,
            after=lambda r: client.drop(base + r),
        )
        result[name] = (timed(get, repeats), put)
        assert getattr(client, "shared", True), "the warehouse refused this process's shared memory"
        client.close()
    out.put(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, nargs="+", default=[4, 64])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for mib in args.mib:
        per = int(mib * 2**20 / 4 / args.samples)
        server = WarehouseServer("127.0.0.1", 0, TOKEN, max_message_bytes=2 << 30).start()
        own = InProcessWarehouse(server, "warehouse", 2 << 30, HostPool(POOL))
        idx = list(range(args.samples))
        own.put(0, idx, {"x": [torch.randn(per) for _ in idx]}, {"x": True})
        src = torch.randn(per * args.samples)
        dst = torch.empty_like(src)
        memcpy = timed(lambda _: dst.copy_(src), args.repeats)
        in_process = timed(lambda _: own.get(0, idx, ["x"]), args.repeats)
        queue = ctx.Queue()
        proc = ctx.Process(target=local_rank_1, args=(server.address, args.samples, per, args.repeats, queue))
        proc.start()
        result = queue.get(timeout=600)
        proc.join()
        server.stop()
        print(f"{mib:g} MiB in {args.samples} samples (medians of {args.repeats})")
        print(f"  memcpy                    {memcpy * 1e3:8.2f} ms")
        print(f"  in process (local rank 0) {in_process * 1e3:8.2f} ms get")
        for name, (get, put) in result.items():
            print(f"  {name:25s} {get * 1e3:8.2f} ms get  {put * 1e3:8.2f} ms put")
        (wg, wp), (sg, sp) = result["wire"], result["shared memory"]
        print(f"  wire / shared memory: get {wg / sg:.1f}x, put {wp / sp:.1f}x", flush=True)


if __name__ == "__main__":
    main()
