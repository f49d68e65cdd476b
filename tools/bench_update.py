#!/usr/bin/env python
"""megatron-core vs FSDP2 (and FSDP2 with LoRA, ``--backends fsdp,fsdp-lora``) on one device,
same model and batch, measured in the same run: the
update (forward + backward + clip + AdamW over micro-batches), the allgather half of
allgather-swap (``Engine.full_weights`` in the compute dtype, consumed bucket by bucket) and the
swap of the training state to host and back (``reshard.swap.HostSwap``, the resharder's own),
with the device bytes left while it is on the host: what generation would see. The first
update's loss and grad norm are printed for both, as a check that they computed the same thing.

Each backend runs in its own process (``--one``), one after the other, so each gets the whole
device; the parent prints one table with megatron / fsdp ratios. Times are means over
``--steps`` updates after one warm-up update, and over ``--rounds`` gathers and swaps. The
model is a random-weight Qwen2 of the given shape (default about 2.4 B parameters, which with
bf16 compute, float32 masters and AdamW fills most of an 80 GiB device), or with ``--experts``
a Qwen3-MoE of the same shape (megatron at EP 1 on one device); the batch is random
token ids with response lengths drawn uniformly in [R/2, R], the same on both sides.

    python tools/bench_update.py                                 # both backends, default shape
    python tools/bench_update.py --hidden 512 --layers 4 --samples 4 --prompt 32 --response 64   # CPU-sized
    python tools/bench_update.py --experts 8 --topk 2 --layers 16                     # MoE
    python tools/bench_update.py --backends fsdp,fsdp-lora --lora-rank 16             # LoRA vs full fine-tuning
    python tools/bench_update.py --backends megatron,megatron-local --response 8192   # SDPA vs unfused attention

``megatron-local`` is the megatron backend with mcore's local ``DotProductAttention`` in place of
its SDPA core attention (``engines.megatron.attention``): the unfused softmax(Q K^T) V that
makes [b, heads, s, s] scores, as this backend ran before (then also from an explicit
[b, 1, s, s] mask; here mcore's default causal one, so the difference shown is the scores').
Peak memory is the device's (``max_memory_allocated``) on a device and the process's peak
resident set (``VmHWM``, reset before the timed updates) on the CPU.

With LoRA the gather is the merged sync's trainer half (``actor.lora.sync: merged``): the
merged weights W + (alpha/r) B A, the same bytes vLLM loads as without LoRA. ``adapter gather
s`` is the adapter sync's (the default): the adapters alone, gathered whole. The swapped bytes
are the frozen base and the adapters' state."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_model(folder: Path, args) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.response,
        tie_word_embeddings=False,
    )
    if (
        args.experts
    ):  # Qwen3-MoE: each expert 1/topk of the dense MLP's width, so a token computes what a dense one does
        cfg, cls = (
            Qwen3MoeConfig(
                **shape,
                intermediate_size=args.hidden * 3,
                moe_intermediate_size=args.hidden * 3 // args.topk,
                num_experts=args.experts,
                num_experts_per_tok=args.topk,
                norm_topk_prob=True,
                head_dim=args.hidden // args.heads,
            ),
            Qwen3MoeForCausalLM,
        )
    else:
        cfg, cls = Qwen2Config(**shape, intermediate_size=args.hidden * 3), Qwen2ForCausalLM
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = cls(cfg).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def batch(args):
    import torch

    from spmd_rl.engines.training.logprobs import build_batch, split

    g = torch.Generator().manual_seed(1)
    lens = (
        torch.randint(args.response // 2, args.response + 1, (args.samples,), generator=g).sort(descending=True).values
    )
    prompts = [torch.randint(1, args.vocab, (args.prompt,), generator=g) for _ in range(args.samples)]
    responses = [torch.randint(1, args.vocab, (int(n),), generator=g) for n in lens]
    b = build_batch(prompts, responses, 0)
    tokens = int(b.mask.sum())
    return split(b, args.micro), tokens


def peak_resident_bytes() -> int:
    """This process's peak resident set since the last reset (``VmHWM``, kB in /proc)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def one(backend: str, folder: Path, args) -> dict:  # noqa: PLR0915
    """Runs in its own process: build, update, gather, swap; returns the measurements."""
    import socket

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    import torch
    import torch.distributed as dist

    from spmd_rl.config.layout import Layout
    from spmd_rl.config.schema import ActorConfig
    from spmd_rl.distributed.accelerator import detect
    from spmd_rl.reshard.swap import HostSwap

    acc = detect("auto", 0)
    acc.set_device()
    dist.init_process_group(acc.backend, rank=0, world_size=1)
    lora = (
        {"lora": {"rank": args.lora_rank, "sync": "merged"}} if backend == "fsdp-lora" else {}
    )  # the gather merges; adapters timed apart
    cfg = ActorConfig(
        mini_batch_size=1, micro_batch_size=args.micro, activation_checkpointing=args.checkpointing, **lora
    )
    t0 = time.perf_counter()
    if backend == "megatron-local":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from spmd_rl.engines.megatron import model

        model.SdpaAttention = DotProductAttention  # the spec's core attention, before any model is built
    if backend.startswith("megatron"):
        from spmd_rl.engines.megatron.engine import MegatronEngine

        engine = MegatronEngine(folder, acc, cfg, args.dtype, tp=1)
    else:
        from spmd_rl.distributed.mesh import train_mesh
        from spmd_rl.engines.fsdp.engine import TrainEngine

        engine = TrainEngine(folder, acc, train_mesh(acc, Layout(1, 1)), cfg, args.dtype)
    build_s = time.perf_counter() - t0
    micro, tokens = batch(args)
    loss_fn = lambda lp, ent, k: -lp.sum() / tokens  # noqa: E731  (token-mean policy gradient, advantages 1)

    def timed(fn) -> float:
        acc.synchronize()
        t = time.perf_counter()
        fn()
        acc.synchronize()
        return time.perf_counter() - t

    first = engine.train_step(
        micro, loss_fn
    )  # warm-up; creates the AdamW state; its loss and grad norm agree across backends
    if acc.kind != "cpu":
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    steps = [timed(lambda: engine.train_step(micro, loss_fn)) for _ in range(args.steps)]
    peak = torch.cuda.max_memory_allocated() if acc.kind != "cpu" else peak_resident_bytes()
    dtype = getattr(torch, args.dtype)

    def gather() -> None:
        _peak, it = engine.full_weights(dtype, args.bucket_mib * 2**20)
        for _name, _t in it:
            pass

    gathers = [timed(gather) for _ in range(args.rounds)]
    adapter_gathers = (
        [timed(lambda: engine.adapter_tensors(dtype)) for _ in range(args.rounds)] if backend == "fsdp-lora" else [0.0]
    )
    swap = HostSwap(acc)
    swap.track(engine.param_tensors() + engine.grad_tensors() + engine.optimizer_tensors())
    outs, ins, left = [], [], []
    for _ in range(args.rounds):
        outs.append(timed(swap.offload))
        acc.empty_cache()
        left.append(torch.cuda.memory_allocated() if acc.kind != "cpu" else None)
        ins.append(timed(swap.reload))
    mean = statistics.mean
    return {
        "backend": backend,
        "device": torch.cuda.get_device_name() if acc.kind == "cuda" else acc.kind,
        "build_s": build_s,
        "loss": first["loss"],
        "grad_norm": first["grad_norm"],
        "update_s": mean(steps),
        "update_tokens_per_s": tokens / mean(steps),
        "peak_bytes": peak,
        "gather_s": mean(gathers),
        "adapter_gather_s": mean(adapter_gathers),
        "swap_out_s": mean(outs),
        "swap_in_s": mean(ins),
        "swapped_bytes": swap.nbytes,
        "left_during_generation": left[-1],
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument(
        "--experts", type=int, default=0, help="a Qwen3-MoE with this many experts per layer (0: dense Qwen2)"
    )
    ap.add_argument("--topk", type=int, default=2, help="experts routed per token (--experts)")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=768)
    ap.add_argument("--micro", type=int, default=4, help="samples per micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="timed updates after the warm-up")
    ap.add_argument("--rounds", type=int, default=3, help="timed gathers and swap round trips")
    ap.add_argument("--bucket-mib", type=float, default=512)
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype; masters and AdamW stay float32 on both sides")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing on both sides")
    ap.add_argument(
        "--backends",
        default="fsdp,megatron",
        help="any of fsdp, megatron, fsdp-lora (FSDP with actor.lora on the default targets), megatron-local "
        "(megatron with mcore's unfused local core attention)",
    )
    ap.add_argument("--lora-rank", type=int, default=16, help="fsdp-lora: the adapters' rank")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, Path(args.folder), args)), flush=True)
        return
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        n = build_model(folder, args)
        print(
            f"model: {n / 1e9:.2f} B params{f', {args.experts} experts top-{args.topk}' if args.experts else ''}, "
            f"hidden {args.hidden}, {args.layers} layers; batch {args.samples} x "
            f"({args.prompt} + <= {args.response}) tokens in micro-batches of {args.micro}",
            flush=True,
        )
        passthrough = [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k not in ("backends", "json", "one", "folder", "checkpointing")
        ]
        passthrough += ["--checkpointing"] if args.checkpointing else []
        for backend in args.backends.split(","):
            done = subprocess.run(
                [sys.executable, __file__, *passthrough, "--one", backend, "--folder", str(folder)],
                capture_output=True,
                text=True,
            )
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not line:
                print(
                    f"{backend} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}",
                    flush=True,
                )
                continue
            rows[backend] = json.loads(line[0].removeprefix("RESULT "))
    gib = 2**30
    print(
        f"\n{'backend':14s} {'update s':>9s} {'tok/s':>8s} {'peak GiB':>9s} {'gather s':>9s} {'adapter gather s':>16s} "
        f"{'swap out s':>10s} "
        f"{'swap in s':>9s} {'swapped GiB':>11s} {'left GiB':>9s} {'loss':>8s} {'grad norm':>9s}   (means; device: "
        f"{next(iter(rows.values()))['device'] if rows else '-'})"
    )
    for b, r in rows.items():
        f = lambda v: f"{v / gib:.2f}" if v is not None else "-"  # noqa: E731
        print(
            f"{b:14s} {r['update_s']:9.3f} {r['update_tokens_per_s']:8.0f} {f(r['peak_bytes']):>9s} "
            f"{r['gather_s']:9.3f} {r['adapter_gather_s']:16.4f} "
            f"{r['swap_out_s']:10.3f} {r['swap_in_s']:9.3f} {f(r['swapped_bytes']):>11s} "
            f"{f(r['left_during_generation']):>9s} {r['loss']:8.4f} {r['grad_norm']:9.4f}"
        )
    for other, base in (("megatron", "fsdp"), ("fsdp-lora", "fsdp"), ("megatron", "megatron-local")):
        if {base, other} <= rows.keys():
            m, s = rows[other], rows[base]
            print(
                f"{other} / {base}: "
                + ", ".join(
                    f"{k} {m[k] / s[k]:.2f}x"
                    for k in ("update_s", "gather_s", "swap_out_s", "swap_in_s", "swapped_bytes", "peak_bytes")
                    if s[k]
                )
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "params": n, "rows": rows}, indent=1))


if __name__ == "__main__":
    from spmd_rl.distributed.teardown import exit_after

    exit_after(main)
