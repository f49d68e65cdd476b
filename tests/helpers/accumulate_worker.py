"""torchrun worker (2 ranks, FSDP over both): one optimizer step of three micro-batches with
and without ``actor.accumulate_unsharded``, counting FSDP2's parameter all-gathers
(``dist.all_gather_single``) in the second step of each. Also runs a forward-only pass after
the step, which must reshard again.

Env: MODEL, SPMD_RL_OUT. Writes accumulate-rank<k>.json.
"""

from spmd_rl.engines.vllm.logs import QUIET_ENV  # noqa: E402
from spmd_rl.launcher.preload import delegate  # noqa: E402

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs (vLLM unused here)


import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import ActorConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.distributed.mesh import train_mesh
from spmd_rl.distributed.teardown import exit_after
from spmd_rl.engines.training.logprobs import build_batch, split
from spmd_rl.engines.fsdp.engine import TrainEngine

GATHERS = {"n": 0}
_all_gather_single = dist.all_gather_single


def counting(*args, **kwargs):
    GATHERS["n"] += 1
    return _all_gather_single(*args, **kwargs)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    acc = detect("cpu")
    mesh = train_mesh(acc, Layout(2, 1))
    micro = [
        build_batch(
            [torch.tensor([5 + rank, 6, 7]), torch.tensor([8, 9])],
            [torch.tensor([11, 12]), torch.tensor([13, 14, 15 + rank])],
            0,
        ),
        build_batch([torch.tensor([4, 5])], [torch.tensor([16, 17, 18])], 0),
        build_batch([torch.tensor([9, 3 + rank])], [torch.tensor([20, 21])], 0),
    ]
    report = {"rank": rank}
    dist.all_gather_single = counting
    for name, accumulate in (("plain", False), ("accumulate", True)):
        cfg = ActorConfig(mini_batch_size=1, micro_batch_size=2, optim={"lr": 1e-3}, accumulate_unsharded=accumulate)
        engine = TrainEngine(os.environ["MODEL"], acc, mesh, cfg, "float32", total_steps=10)
        first = engine.train_step(micro, lambda lp, ent, k: -lp.sum())
        GATHERS["n"] = 0
        steps = [first, engine.train_step(micro, lambda lp, ent, k: -lp.sum())]
        step_gathers = GATHERS["n"]
        GATHERS["n"] = 0
        lp, _ = engine.infer(split(micro[0], 2))
        engine.infer(split(micro[0], 2))
        report[name] = {
            "step_gathers": step_gathers,
            "infer_gathers": GATHERS["n"],
            "steps": steps,
            "logprobs": lp.flatten().tolist(),
            "fsdp_modules": sum(isinstance(m, FSDPModule) for m in engine.model.modules()),
        }
    Path(os.environ["SPMD_RL_OUT"], f"accumulate-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    exit_after(main)
