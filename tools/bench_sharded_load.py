"""Peak memory of building the training engine's model: sharded (engines.training.hf_weights, what
TrainEngine uses) vs whole (the old path: from_pretrained on every rank, then shard).

    python tools/bench_sharded_load.py [--out runs/bench-load] [--nproc 2]

builds a random ~100M-parameter Qwen2 (fp32) unless the folder exists, runs both builds under
torchrun on one node with FSDP over every rank, and prints each rank's peak RSS growth and the
ratio sharded / whole. Under torchrun (RANK set) this file is the worker, also used by
tests/integration/test_sharded_load.py: it builds the model, records the peak RSS growth of the build and
whether every parameter equals the checkpoint's tensor. Worker env: MODEL, TRAIN_DP, TRAIN_TP,
SPMD_RL_OUT, MODE.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from spmd_rl.config.layout import Layout
from spmd_rl.distributed.accelerator import detect
from spmd_rl.distributed.mesh import train_mesh
from spmd_rl.distributed.teardown import exit_after
from spmd_rl.engines.training.hf_weights import SafetensorsFolder, build_sharded
from spmd_rl.engines.fsdp.parallelize import parallelize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import status_kib  # noqa: E402


def worker() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    acc = detect("cpu")
    dp, tp = int(os.environ["TRAIN_DP"]), int(os.environ["TRAIN_TP"])
    mesh = train_mesh(acc, Layout(dp, tp))
    path = os.environ["MODEL"]
    dist.barrier()
    before = status_kib("VmRSS")
    if os.environ["MODE"] == "sharded":
        model = build_sharded(path, torch.float32, acc.device, lambda m: parallelize(m, mesh))
    else:
        model = parallelize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(acc.device), mesh)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, since process start
    after = status_kib("VmRSS")
    weights = SafetensorsFolder(path)
    exact = all(torch.equal(p.full_tensor(), weights.read(n)) for n, p in model.named_parameters())
    report = {
        "rank": rank,
        "before": before << 10,
        "peak": peak << 10,
        "after": after << 10,
        "exact": exact,
        "local_param_bytes": sum(p.to_local().numel() * 4 for p in model.parameters()),
    }
    Path(os.environ["SPMD_RL_OUT"], f"load-{os.environ['MODE']}-rank{rank}.json").write_text(json.dumps(report))


def hundred_m_model(folder: Path) -> tuple[int, int]:
    """A random ~100M-parameter Qwen2 (fp32 safetensors) unless ``folder`` has one; returns
    (model bytes, one decoder layer's bytes)."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=13,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=8000,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(cfg)
    if not (folder / "model.safetensors").is_file():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return sum(p.numel() * 4 for p in shapes.parameters()), sum(
        p.numel() * 4 for p in shapes.model.layers[0].parameters()
    )


def run_workers(script: str, nproc: int, env: dict[str, str], what: str) -> None:
    """Run ``script`` as the worker under standalone torchrun (one node, ``nproc`` ranks, one
    thread each); exit with its stderr's tail if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script]
    done = subprocess.run(cmd, env=dict(os.environ) | {"OMP_NUM_THREADS": "1"} | env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")


def launch(model: Path, out: Path, mode: str, dp: int, tp: int) -> list[dict]:
    """Run the worker under torchrun (one node, dp * tp ranks); the ranks' reports."""
    run_workers(
        __file__,
        dp * tp,
        {"MODEL": str(model), "SPMD_RL_OUT": str(out), "MODE": mode, "TRAIN_DP": str(dp), "TRAIN_TP": str(tp)},
        f"{mode} build",
    )
    return [json.loads((out / f"load-{mode}-rank{r}.json").read_text()) for r in range(dp * tp)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/bench-load"))
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    full, layer = hundred_m_model(args.out / "m100")
    growth = {
        m: [r["peak"] - r["before"] for r in launch(args.out / "m100", args.out, m, args.nproc, 1)]
        for m in ("whole", "sharded")
    }
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    print(f"model {mib(full)}, one layer {mib(layer)}, {args.nproc} ranks (FSDP)")
    for m, g in growth.items():
        print(f"  {m:8s} peak RSS growth per rank: {', '.join(mib(x) for x in g)}")
    print(
        f"  ratio sharded / whole: {max(growth['sharded']) / max(growth['whole']):.2f} "
        f"(ideal about 1/{args.nproc} + one layer / full = {1 / args.nproc + layer / full:.2f})"
    )


if __name__ == "__main__":
    exit_after(worker) if "RANK" in os.environ else main()
