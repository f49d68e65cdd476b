"""What a rollout engine costs before its first useful token: build (vLLM's ``LLM``, KV cache
allocated) and the first and second generation, each variant in fresh processes, median of
``--repeats``. Variants:

- ``compiled-1GiB``: the baseline, as before: vLLM compiles its sampler helpers on the
  first call (``torch.compile`` whatever ``enforce_eager`` says) and a 1 GiB KV cache;
- ``eager-1GiB``: ``rollout.vllm.enforce_eager`` keeps them eager (``vllm_options.eager_sampler``);
- ``eager-<kv>GiB``: and the quickstart's smaller KV cache (the CPU worker zeroes all of it);
- ``eager-<kv>GiB-unfrozen``: the same without freezing the import heap first
  (``rollout._freeze_import_heap``), so vLLM's model load walks it in full collections.

Each child imports ``spmd_rl.train`` first, so its heap is a rank's.

Prints one table with ratios against the baseline. Run from the repository root:
``python tools/bench_engine_start.py --model assets/tiny-qwen2``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time


def child(model: str, kv_gib: float, eager: bool, freeze: bool) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import spmd_rl.train  # noqa: F401  (a rank's imports: the heap the collector walks)
    from spmd_rl.config.schema import RolloutConfig
    from spmd_rl.distributed.accelerator import detect
    from spmd_rl.engines.vllm import engine as rollout
    from spmd_rl.engines.vllm.logs import quiet_vllm

    quiet_vllm(None, 0)
    if not eager:  # the baseline: vLLM's torch.compile of its sampler helpers runs
        rollout.eager_sampler = lambda cfg: contextlib.nullcontext()
    if not freeze:
        rollout._freeze_import_heap = lambda: None
    t0, c0 = time.perf_counter(), time.process_time()
    engine = rollout.VllmRollout.build(
        model,
        detect("cpu"),
        RolloutConfig(n=8, max_response_length=8, kv_cache_gib=kv_gib),
        tp=1,
        dtype="float32",
        max_model_len=64,
        seed=0,
        distributed=False,
    )
    t1, c1 = time.perf_counter(), time.process_time()
    prompts = [[3, 17, 42, 5, 9 + k] for k in range(16)]
    engine.generate(prompts, n=8, max_tokens=8, temperature=1.0, seed=1)
    t2 = time.perf_counter()
    engine.generate(prompts, n=8, max_tokens=8, temperature=1.0, seed=2)
    t3 = time.perf_counter()
    return {"build_s": t1 - t0, "build_cpu_s": c1 - c0, "first_s": t2 - t1, "second_s": t3 - t2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="assets/tiny-qwen2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=0.25, help="The smaller KV cache of the third variant.")
    ap.add_argument("--child", nargs=3, metavar=("KV_GIB", "EAGER", "FREEZE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, float(args.child[0]), args.child[1] == "1", args.child[2] == "1")))
        return
    small = f"eager-{args.kv_gib:g}GiB"
    variants = {
        "compiled-1GiB": (1.0, False, True),
        "eager-1GiB": (1.0, True, True),
        small: (args.kv_gib, True, True),
        f"{small}-unfrozen": (args.kv_gib, True, False),
    }
    got: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved, so drift on the machine touches every variant alike
        for name, (kv, eager, freeze) in variants.items():
            res = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--model",
                    args.model,
                    "--child",
                    str(kv),
                    "1" if eager else "0",
                    "1" if freeze else "0",
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if res.returncode != 0:
                sys.exit(f"{name}: the child failed:\n{res.stderr[-3000:]}")
            got[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    med = {
        name: {k: statistics.median(r[k] for r in runs) for k in ("build_s", "build_cpu_s", "first_s", "second_s")}
        for name, runs in got.items()
    }
    base = med["compiled-1GiB"]
    base_total = base["build_s"] + base["first_s"]
    print(
        f"median of {args.repeats} fresh processes per variant; model {args.model}; 16 prompts x 8 samples x 8 tokens"
    )
    print(
        f"{'variant':<24} {'build s':>8} {'build CPU s':>12} {'first gen s':>12} {'second gen s':>13} "
        f"{'build+first s':>14} {'vs baseline':>12}"
    )
    for name, m in med.items():
        total = m["build_s"] + m["first_s"]
        print(
            f"{name:<24} {m['build_s']:>8.2f} {m['build_cpu_s']:>12.2f} {m['first_s']:>12.2f} {m['second_s']:>13.3f} "
            f"{total:>14.2f} {base_total / total:>11.2f}x"
        )


if __name__ == "__main__":
    main()
