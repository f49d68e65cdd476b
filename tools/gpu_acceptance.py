#!/usr/bin/env python
"""The acceptance run on one GPU node, scheduled to fit the device time it gets (issue 70,
finding 3): the steps in order of value, one total budget (default 12 minutes, the offline
install included), each step's limit what its own cap and the budget leave, and each step's
line in ``OUT/status.tsv`` written the moment it ends, so a run cut off by the device's own
limit still returns everything it did. A step that failed is recorded and the next one runs,
except the install and the weights, without which nothing else can; a step the budget no longer
fits is recorded as skipped (status ``skip``).

    bash tools/gpu_acceptance.sh BUNDLE OUT                 # on the node (tools/gpu_acceptance.sh)
    python tools/gpu_acceptance.py BUNDLE OUT --rehearse 0.01   # the same schedule on CPU, scaled

``--rehearse S`` replaces each step's command with a sleep of its expected seconds x S and scales
the budget and the caps by S: the schedule, not the steps, is what it tests. The expected seconds
are estimates for one H100 (``EXPECTED``), not measurements.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL, CONFIG = "assets/gpu-qwen2.5-1.5b", "configs/gpu_qwen25_1_5b.yaml"


@dataclass(frozen=True)
class Step:
    name: str
    cap_s: float
    """The most this step may take, whatever the budget leaves."""
    expected_s: float
    """An estimate of its seconds on one H100 (the rehearsal sleeps this long, scaled)."""
    argv: tuple[str, ...]
    needed: bool = False
    """Nothing after it can run when it fails."""


def steps(bundle: str, out: Path, site: str) -> list[Step]:
    """The steps, most valuable first (issue 70: install, gpu_smoke, the 1.5B config, TRL
    side by side, megatron against FSDP, SDPA at 16 k; the memory and sync seconds come with them)."""
    py = sys.executable
    return [
        Step("install", 180, 90, (py, "launch/offline_install.py", "install", bundle, "--target", site), needed=True),
        Step("doctor", 60, 15, (py, "-m", "spmd_rl.cli", "doctor", CONFIG)),
        Step(
            "weights", 120, 60, (py, "tools/make_gpu_model.py", "--out", MODEL, "--weights", "--device", "cuda"), True
        ),
        Step("smoke", 300, 240, (py, "tools/gpu_smoke.py", "--nproc-per-node", "1", "--out", str(out / "smoke"))),
        Step(
            "run",
            420,
            300,
            (
                py,
                "-m",
                "spmd_rl.cli",
                "train",
                CONFIG,
                f"logging.dir={out}/run/logs",
                f"checkpoint.dir={out}/run/ckpt",
                "logging.progress=false",
            ),
        ),
        Step("trl", 420, 300, (py, "tools/bench_trl.py", CONFIG, "--mode", "vllm", "--steps", "6")),
        Step(
            "update",
            300,
            200,
            (
                py,
                "tools/bench_update.py",
                "--hidden",
                "1536",
                "--layers",
                "28",
                "--heads",
                "12",
                "--kv-heads",
                "2",
                "--vocab",
                "151936",
                "--samples",
                "16",
                "--prompt",
                "256",
                "--response",
                "1024",
                "--micro",
                "4",
                "--checkpointing",
                "--json",
                str(out / "update.json"),
            ),
        ),
        Step(
            "attention",
            180,
            120,
            (
                py,
                "tools/bench_update.py",
                "--hidden",
                "1536",
                "--layers",
                "4",
                "--heads",
                "12",
                "--kv-heads",
                "2",
                "--vocab",
                "151936",
                "--samples",
                "2",
                "--prompt",
                "256",
                "--response",
                "16384",
                "--micro",
                "1",
                "--steps",
                "2",
                "--rounds",
                "1",
                "--backends",
                "megatron,megatron-local",
                "--json",
                str(out / "attention.json"),
            ),
        ),
    ]


def schedule(all_steps: list[Step], out: Path, budget_s: float, scale: float | None, env: dict) -> list[tuple]:
    """Run the steps within ``budget_s``; returns (name, status, seconds, limit) per step, each
    also appended to ``OUT/status.tsv`` as it ends. ``scale``: the rehearsal's (module docstring)."""
    start, rows = time.monotonic(), []
    for s in all_steps:
        cap, left = s.cap_s * (scale or 1), budget_s - (time.monotonic() - start)
        limit = min(cap, left)
        if limit < min(cap, 0.25 * s.expected_s * (scale or 1)):  # not even a quarter of what it needs
            rows.append(_record(out, (s.name, "skip", 0.0, round(limit, 3))))
            continue
        argv = s.argv if scale is None else (sys.executable, "-c", f"import time; time.sleep({s.expected_s * scale})")
        t = time.monotonic()
        with open(out / f"{s.name}.log", "w") as log:
            try:
                rc = subprocess.run(
                    argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        rows.append(_record(out, (s.name, str(rc), round(time.monotonic() - t, 3), round(limit, 3))))
        if rc != 0 and s.needed:
            break
    return rows


def _record(out: Path, row: tuple) -> tuple:
    line = "\t".join(str(x) for x in row)
    print(f"[acceptance] {line}", flush=True)
    with open(out / "status.tsv", "a") as f:
        f.write(line + "\n")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget-s", type=float, default=720.0, help="seconds for every step, the install included")
    ap.add_argument("--site", default=os.environ.get("SITE", "/tmp/spmd-rl-site"))
    ap.add_argument("--rehearse", type=float, default=None, metavar="SCALE")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (args.site, str(REPO), env.get("PYTHONPATH", "")) if p)
    budget = args.budget_s * (args.rehearse or 1)
    rows = schedule(steps(args.bundle, args.out, args.site), args.out, budget, args.rehearse, env)
    return 0 if rows and all(r[1] == "0" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
