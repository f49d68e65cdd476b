#!/usr/bin/env python
"""Resharding benchmark: naive vs allgather-swap on one model, measured in the same run.

Builds a random-weight Qwen2 model of the given size, a training engine per ``--backends``
(FSDP2, megatron-core; AdamW state initialised by one step) and an in-process vLLM engine, then for each path times
train -> generation (gather + weight load [+ swap to host]) and generation -> train, and reads
the memory ledger's generation-stage bytes. The swap bandwidth is printed against a plain host
memcpy of the same bytes into already-touched memory (torch's ``copy_``, all intra-op threads),
for the resharder's own swap, for one copy thread and for parallel copies
(``HostSwap(threads=...)``). The memcpy is timed right before every swap round trip and each
round gives its own ratios, of which the median is printed (this machine's memcpy alone varies
by 1.5x between moments). On a GPU the allocator's ``max_memory_allocated`` during
generation is printed too.

    python tools/bench_reshard.py --hidden 512 --layers 8          # ~30 M params, CPU
    python tools/bench_reshard.py --backends fsdp,megatron         # megatron / fsdp ratios too
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_model(folder: Path, args) -> int:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    cfg = Qwen2Config(
        vocab_size=max(len(tok), args.vocab),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def swap_vs_memcpy(swap, rounds: int) -> dict:
    """Median over ``rounds`` of (memcpy GiB/s, swap D2H and H2D GiB/s, their ratios to that
    round's memcpy); each round times a plain copy of ``swap.nbytes`` into touched memory
    right before its offload + reload."""
    import statistics

    import torch

    src = torch.ones(swap.nbytes, dtype=torch.uint8)
    dst = torch.zeros(swap.nbytes, dtype=torch.uint8)  # touched: no page faults in the timed copy
    rows = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        swap.offload()
        t2 = time.perf_counter()
        swap.reload()
        t3 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2))
    gib = swap.nbytes / 1024**3
    med = {
        k: statistics.median(f(r) for r in rows)
        for k, f in (
            ("memcpy", lambda r: gib / r[0]),
            ("d2h", lambda r: gib / r[1]),
            ("h2d", lambda r: gib / r[2]),
            ("d2h_ratio", lambda r: r[0] / r[1]),
            ("h2d_ratio", lambda r: r[0] / r[2]),
        )
    }
    return med | {"rounds": rounds}


def reshard_rounds(rs, rollout, acc, rounds: int) -> dict:
    """Best times of ``rounds`` train -> generation -> train round trips, the ledger's
    generation-stage bytes and the gather's peak."""
    fwd, back = [], []
    for _ in range(rounds):
        acc.reset_peak_memory_stats()
        t0 = time.perf_counter()
        rs.to_generation()
        t1 = time.perf_counter()
        rollout.generate([[1, 2, 3]], n=1, max_tokens=2, temperature=0.0)
        device_peak = acc.max_memory_allocated()
        t2 = time.perf_counter()
        rs.to_training()
        fwd.append(t1 - t0)
        back.append(time.perf_counter() - t2)
    return {
        "to_generation_s": min(fwd),
        "to_training_s": min(back),
        "generation_bytes": rs.ledger.total("generate"),
        "temp_peak": rs.temp_peak,
        "device_peak": device_peak,
    }


def main() -> None:  # noqa: PLR0915
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--bucket-mib", type=float, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="Reshard round trips per path (best time is printed).")
    ap.add_argument(
        "--swap-rounds", type=int, default=7, help="Swap round trips, each after its own memcpy (medians are printed)."
    )
    ap.add_argument("--tokenizer", default=str(REPO / "assets/tiny-qwen2"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--backends", default="fsdp", help="training backends to reshard from, in order (fsdp,megatron)")
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from spmd_rl.dock.etcd_server import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import torch
    import torch.distributed as dist

    from spmd_rl.config.layout import Layout
    from spmd_rl.config.schema import ActorConfig, ReshardConfig, RolloutConfig
    from spmd_rl.distributed.accelerator import detect
    from spmd_rl.distributed.mesh import train_mesh
    from spmd_rl.engines.training.logprobs import build_batch
    from spmd_rl.engines.vllm.engine import VllmRollout
    from spmd_rl.engines.fsdp.engine import TrainEngine
    from spmd_rl.reshard.allgather_swap import Resharder

    acc = detect("auto", 0)
    dist.init_process_group(acc.backend, rank=0, world_size=1)
    cfg = ActorConfig(mini_batch_size=1, micro_batch_size=2)
    engines = {"fsdp": lambda folder: TrainEngine(folder, acc, train_mesh(acc, Layout(1, 1)), cfg, "float32")}
    if "megatron" in args.backends:
        from spmd_rl.engines.megatron.engine import MegatronEngine

        engines["megatron"] = lambda folder: MegatronEngine(folder, acc, cfg, "float32", tp=1)
    results, swaps = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        n_params = build_model(folder, args)
        rollout = VllmRollout.build(
            folder,
            acc,
            RolloutConfig(n=1, max_response_length=4),
            tp=1,
            dtype="float32",
            max_model_len=64,
            distributed=False,
        )
        for backend in args.backends.split(","):
            engine = engines[backend](folder)
            batch = build_batch([torch.tensor([1, 2, 3])] * 2, [torch.tensor([4, 5])] * 2, 0)
            engine.train_step([batch], lambda lp, ent, k: -lp.sum())  # creates AdamW state
            for mode in ("naive", "allgather_swap"):
                rs = Resharder(
                    engine, rollout, ReshardConfig(mode=mode, bucket_bytes=int(args.bucket_mib * 2**20)), "float32"
                )
                results[f"{backend} {mode}"] = reshard_rounds(rs, rollout, acc, args.rounds)
                if mode == "allgather_swap" and not swaps:
                    print(rs.ledger.table())
                    swaps = {"resharder's swap": swap_vs_memcpy(rs.swap, args.swap_rounds)}
                    swapped = rs.swap.nbytes
                    from spmd_rl.reshard.swap import HostSwap

                    for k in (
                        1,
                        torch.get_num_threads(),
                    ):  # the swap alone: sequential vs parallel copies, same tensors
                        swap = HostSwap(acc, threads=k)
                        swap.track(engine.param_tensors() + engine.grad_tensors() + engine.optimizer_tensors())
                        swaps[f"{k} copy thread(s)"] = swap_vs_memcpy(swap, args.swap_rounds)
    mib = 2**20
    print(
        f"\nmodel {n_params / 1e6:.1f} M params (fp32 master + AdamW), device {acc.kind}, bucket {args.bucket_mib:g} "
        f"MiB"
    )
    for name, r in results.items():
        dev = f", device peak {r['device_peak'] / mib:.1f} MiB" if r["device_peak"] is not None else ""
        print(
            f"  {name:24s} train->gen {r['to_generation_s']:.3f} s  gen->train {r['to_training_s']:.3f} s  "
            f"generation-stage bytes {r['generation_bytes'] / mib:9.1f} MiB  gather buffer peak "
            f"{r['temp_peak'] / mib:7.1f} MiB{dev}"
        )
    for backend in args.backends.split(","):
        n, s = results[f"{backend} naive"], results[f"{backend} allgather_swap"]
        print(
            f"  {backend}: saved in generation {(n['generation_bytes'] - s['generation_bytes']) / mib:.1f} MiB "
            f"({n['generation_bytes'] / max(1, s['generation_bytes']):.2f}x less)"
        )
    if "megatron" in args.backends and "fsdp" in args.backends:
        for mode in ("naive", "allgather_swap"):
            m, f = results[f"megatron {mode}"], results[f"fsdp {mode}"]
            print(
                f"  megatron / fsdp, {mode}: train->gen {m['to_generation_s'] / f['to_generation_s']:.2f}x, "
                f"gen->train {m['to_training_s'] / f['to_training_s']:.2f}x, generation-stage bytes "
                f"{m['generation_bytes'] / f['generation_bytes']:.2f}x"
            )
    print(
        f"  swap of {swapped / mib:.1f} MiB ({args.backends.split(',')[0]}), medians of {args.swap_rounds} rounds, "
        f"each against the memcpy just before it:"
    )
    for name, m in swaps.items():
        print(
            f"    {name:18s} D2H {m['d2h']:6.2f} GiB/s, H2D {m['h2d']:6.2f} GiB/s; memcpy {m['memcpy']:6.2f} GiB/s; "
            f"ratios to memcpy D2H {m['d2h_ratio']:.2f}, H2D {m['h2d_ratio']:.2f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "params": n_params, "results": results, "swaps": swaps}, indent=1)
        )
    # the process group stays up: vLLM tears down its own groups at exit


if __name__ == "__main__":
    from spmd_rl.distributed.teardown import exit_after

    exit_after(main)
