"""Accelerator smoke run: the quickstart shape through the real trainer on cuda / npu (or cpu),
once with ``reshard.mode=naive`` and once with ``allgather_swap``, printing the memory held as
generation starts (the device allocator's bytes off CPU, the ledger's resident bytes always)
and the iteration time of each.

    python tools/gpu_smoke.py                          # 1 device, world 1 (NCCL / HCCL group)
    python tools/gpu_smoke.py --nproc-per-node 4       # 4 devices, FSDP 4 / generation DP 4
    python tools/gpu_smoke.py --device cpu             # the same path on CPU (what CI runs)

Extra ``key=value`` arguments go to every run's config (e.g. model.dtype=bfloat16).
Exit status: non-zero when a run fails (the run's log tail is printed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("naive", "allgather_swap")


def run_mode(mode: str, args: argparse.Namespace) -> list[dict]:
    out = args.out / mode
    n = args.nproc_per_node
    cmd = [sys.executable, "-m", "spmd_rl.cli", "train", str(REPO / "configs/quickstart.yaml"), f"trainer.device={args.device}",
           f"parallel.nproc_per_node={n}", f"parallel.train.dp_shard={n}", f"parallel.gen.dp={n}", f"reshard.mode={mode}",
           f"trainer.iterations={args.iterations}", f"checkpoint.dir={out}/ckpt", f"logging.dir={out}/logs",
           "checkpoint.interval=0", "logging.progress=false", f"metadata.job=gpu-smoke-{mode}", *args.overrides]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        print(f"[{mode}] failed with exit status {done.returncode}:\n{done.stderr[-4000:]}", file=sys.stderr)
        raise SystemExit(done.returncode)
    return [json.loads(line) for line in (out / "logs/metrics.jsonl").read_text().splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"])
    ap.add_argument("--nproc-per-node", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "runs/gpu-smoke")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = ap.parse_args()
    rows = {mode: run_mode(mode, args) for mode in MODES}
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    last = {mode: r[-1] for mode, r in rows.items()}
    source = "mem_actor_rollout_device_bytes" if "mem_actor_rollout_device_bytes" in last["naive"] else "mem_actor_rollout_bytes"
    print(f"device {args.device}, {args.nproc_per_node} rank(s), {args.iterations} iterations; memory as generation starts "
          f"({'device allocator' if source.endswith('device_bytes') else 'ledger: no device allocator on CPU'}), max over ranks")
    for mode in MODES:
        r = last[mode]
        print(f"  {mode:15s} {mib(r[source]):>14s}   ledger {mib(r['mem_actor_rollout_bytes']):>14s}   "
              f"iteration {r['iteration_s']:.2f} s   reward {r['reward_mean']:.3f}")
    naive, swap = last["naive"][source], last["allgather_swap"][source]
    print(f"  saving {mib(naive - swap)}; allgather_swap / naive: {swap / naive:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
