#!/usr/bin/env python
"""``spmd-rl export`` of a full model: peak host memory and bytes written, streamed shard by
shard against the previous export (the whole checkpoint read at once, the HF model built in
float32 and saved by ``save_pretrained``), on one checkpoint made here, in one run.

The model is a random Qwen2 of ``--layers`` layers at hidden size 1024 (about 0.5 GB in float32
at 8 layers); its checkpoint is written with DCP as the FSDP engine writes it (float32 weights
and two optimizer moments) with a trainer state naming ``model.dtype: bfloat16``. Each export
runs in its own process, ``--rounds`` times, alternating; printed per side: the median peak
resident memory above the process's resident memory just before the export (``VmHWM``, reset
by ``/proc/self/clear_refs`` after the imports, minus the RSS then), the median seconds, and
the bytes written; then the ratios.

    python tools/bench_export.py --layers 8 --shard-mb 100 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_checkpoint(folder: Path, layers: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    base = folder / "base"
    cfg = Qwen2Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=2048,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(base)
    AutoTokenizer.from_pretrained(REPO / "assets/tiny-qwen2").save_pretrained(base)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    optim = {f"{n}.{m}": torch.zeros_like(p) for n, p in weights.items() for m in ("exp_avg", "exp_avg_sq")}
    dcp.save(
        {"model": weights, "optim": optim}, storage_writer=dcp.FileSystemWriter(str(folder / "ckpt")), no_dist=True
    )
    state = {"iteration": 1, "model_path": str(base), "tokenizer_path": str(base)}
    (folder / "ckpt/trainer_state.json").write_text(json.dumps(state | {"config": {"model": {"dtype": "bfloat16"}}}))


def previous_export(ckpt: Path, out: Path) -> None:
    """The export before streaming: every tensor of the checkpoint read, the HF model in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from spmd_rl.trainer.checkpoint import model_weights, read_state

    state = read_state(ckpt)
    weights = model_weights(ckpt)
    model = AutoModelForCausalLM.from_pretrained(state["model_path"], dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)


def child(side: str, ckpt: Path, out: Path, shard_mb: int) -> None:
    import psutil
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from spmd_rl.trainer.export import export

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak counts from here (Linux >= 4.0)
    before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    if side == "streamed":
        export(ckpt, out, max_shard_bytes=shard_mb * 10**6)
    else:
        previous_export(ckpt, out)
    seconds = time.perf_counter() - t0
    peak = _hwm_bytes()
    written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(json.dumps({"peak_mb": (peak - before) / 1e6, "seconds": seconds, "written_mb": written / 1e6}))


def _hwm_bytes() -> int:
    """This process's peak resident memory since the reset (``VmHWM``)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shard-mb", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        side, ckpt, out = args.child
        return child(side, Path(ckpt), Path(out), args.shard_mb)
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), args.layers)
        got: dict[str, list[dict]] = {"previous": [], "streamed": []}
        for r in range(args.rounds):
            for side in got:
                out = Path(tmp) / f"{side}-{r}"
                cmd = [sys.executable, __file__, "--shard-mb", str(args.shard_mb)]
                cmd += ["--child", side, f"{tmp}/ckpt", str(out)]
                res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
                got[side].append(json.loads(res.stdout.strip().splitlines()[-1]))
    med = {s: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for s, rows in got.items()}
    print(f"{args.layers} layers, shards of {args.shard_mb} MB, {args.rounds} rounds, medians")
    print(f"{'side':>10} {'peak MB':>9} {'seconds':>8} {'written MB':>11}")
    for s, m in med.items():
        print(f"{s:>10} {m['peak_mb']:9.0f} {m['seconds']:8.2f} {m['written_mb']:11.0f}")
    p, q = med["streamed"], med["previous"]
    print(
        f"streamed / previous: peak {p['peak_mb'] / q['peak_mb']:.3f}, written {p['written_mb'] / q['written_mb']:.3f}"
    )


if __name__ == "__main__":
    main()
