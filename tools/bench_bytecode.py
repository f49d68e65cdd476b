#!/usr/bin/env python
"""What compiled byte-code saves each fresh process: import times with the environment's
``__pycache__`` (``launch/setup.sh`` compiles it) against the same imports compiled from source,
as every process did where ``PYTHONDONTWRITEBYTECODE`` is set and nothing had compiled them.

    python tools/bench_bytecode.py --rounds 5

Each round starts one fresh interpreter per variant and module, alternating; the source variant
points ``PYTHONPYCACHEPREFIX`` at an empty folder, so no ``.pyc`` is found and none is written.
Prints the median wall seconds per variant and their ratio, one row per module.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODULES = {
    "spmd_rl.train": "a rank's program (before its preload fork)",
    "vllm.v1.engine.core": "a spawned vLLM engine core (separated placement)",
    "transformers": "a tool or helper process",
}


def timed(module: str, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    base = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", VLLM_TARGET_DEVICE="cpu")
    with tempfile.TemporaryDirectory() as empty:
        variants = {"compiled": base, "source": base | {"PYTHONPYCACHEPREFIX": empty}}
        seconds = {(m, v): [] for m in MODULES for v in variants}
        for _ in range(args.rounds):
            for module in MODULES:
                for name, env in variants.items():
                    seconds[module, name].append(timed(module, env))
    cpu = os.popen("lscpu | grep 'Model name' | cut -d: -f2").read().strip()
    print(f"{cpu}, {os.cpu_count()} cores; median of {args.rounds} fresh processes each, alternating")
    print("| import | for | from source s | compiled s | ratio |\n|---|---|---|---|---|")
    for module, what in MODULES.items():
        src, comp = statistics.median(seconds[module, "source"]), statistics.median(seconds[module, "compiled"])
        print(f"| `{module}` | {what} | {src:.2f} | {comp:.2f} | {src / comp:.2f}x |")


if __name__ == "__main__":
    main()
