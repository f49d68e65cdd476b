"""Host memory of a separated generator taking one published policy: streamed vs whole.

    python tools/bench_weight_stream.py [--params-m 100] [--bucket-mib 64]

Two gloo processes on loopback: rank 0 broadcasts random fp32 weights (``--params-m`` million
parameters in 64 tensors) with ``reshard.broadcast.send``; rank 1 receives them into a
safetensors file, as a generator does before its vLLM engine loads it, in two modes:

- ``stream`` (what ``async_loop.receive`` does): ``broadcast.receive`` yields one bucket at a
  time and ``engines.vllm.weight_file.write`` writes each tensor as it arrives;
- ``whole`` (the baseline, the previous path): every tensor is received into a list, then
  ``safetensors.torch.save_file`` writes the dict.

Each mode runs in fresh processes; the receiver's peak RSS growth over the receive is printed
with the ratio stream / whole and the model bytes, and both files are checked to hold the
tensors the sender sent (their digests against ``broadcast.send``'s).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spmd_rl.dock.etcd_server import free_port
from spmd_rl.engines.vllm import weight_file
from spmd_rl.reshard import broadcast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import status_kib  # noqa: E402

TENSORS = 64


def weights(params: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(f"layer{k}.weight", torch.randn(params // TENSORS, generator=g)) for k in range(TENSORS)]


def peer(rank: int, port: int, mode: str, params: int, limit: int, folder: str, q) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cpu = torch.device("cpu")
    if rank == 0:
        w = weights(params)
        dist.barrier()
        q.put(
            ("sent", broadcast.send(1, [(n, t.dtype, list(t.shape)) for n, t in w], iter(w), limit, 0, None, cpu, True))
        )
    else:
        dist.barrier()
        before, path = status_kib("VmRSS"), os.path.join(folder, f"{mode}.safetensors")
        _, meta, stream = broadcast.receive(limit, 0, None, cpu)
        if mode == "stream":
            weight_file.write(path, meta, stream)
        else:
            from safetensors.torch import save_file

            save_file(dict(list(stream)), path)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, since process start
        from safetensors.torch import load_file

        back = load_file(path)  # after the peak was taken
        q.put((mode, (peak - before) << 10, os.path.getsize(path), broadcast.digest(back[n] for n, _, _ in meta)))
    dist.destroy_process_group()


def run(mode: str, params: int, limit: int, folder: str) -> tuple:
    """(mode, peak growth, file size, digest of the file's tensors, digest the sender sent)."""
    ctx, port = mp.get_context("spawn"), free_port()
    q = ctx.Queue()
    procs = [ctx.Process(target=peer, args=(r, port, mode, params, limit, folder, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict((m[0], m[1:]) for m in (q.get(timeout=600), q.get(timeout=600)))
    for p in procs:
        p.join(120)
    return (mode, *got[mode], got["sent"][0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-m", type=float, default=100, help="Million fp32 parameters to publish.")
    ap.add_argument("--bucket-mib", type=float, default=64, help="reshard.bucket_bytes of the broadcast, in MiB.")
    args = ap.parse_args()
    params, limit = int(args.params_m * 1e6) // TENSORS * TENSORS, int(args.bucket_mib * 2**20)
    with tempfile.TemporaryDirectory() as folder:
        res = {mode: run(mode, params, limit, folder) for mode in ("whole", "stream")}
    model = params * 4
    for mode, (_, grow, size, _, _) in res.items():
        print(
            f"  {mode:6s} receiver peak RSS growth {grow / 2**20:8.1f} MiB  ({grow / model:.2f}x model)  file "
            f"{size / 2**20:.1f} MiB"
        )
    print(
        f"model {model / 2**20:.1f} MiB, bucket {args.bucket_mib:g} MiB; stream / whole peak: "
        f"{res['stream'][1] / res['whole'][1]:.2f}"
    )
    same = all(r[3] == r[4] for r in res.values())
    print("both files hold the sent tensors bit for bit" if same else "the files' tensors differ")


if __name__ == "__main__":
    main()
