"""torchrun worker (2 ranks, gloo): plan token-budget micro-batches for three mini-batches whose
greedy counts differ between the ranks, through ``micro_plan``'s one MAX all-reduce.

Env: SPMD_RL_OUT. Writes plan<rank>.json (greedy counts, the plan, the rows).
"""

from spmd_rl.engines.vllm.logs import QUIET_ENV  # noqa: E402
from spmd_rl.launcher.preload import delegate  # noqa: E402

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs (vLLM unused here)


import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_rl.config.loader import load_config
from spmd_rl.distributed.teardown import exit_after
from spmd_rl.trainer.stages.micro import micro_plan, token_runs
from tests.conftest import REPO

LENGTHS = (
    [30, 30, 30, 30, 10, 9, 8, 7, 6, 5, 4, 3],  # rank 0: long first mini-batch, short second
    [12, 11, 10, 9, 40, 35, 30, 5, 20, 20, 20, 20],
)  # rank 1: the other way round


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = load_config(REPO / "configs/quickstart.yaml", ["actor.micro_batch_tokens=60"])  # packed (the default)
    lengths = torch.tensor(LENGTHS[rank])
    minis = [slice(0, 4), slice(4, 8), slice(8, 12)]
    rows = [lengths[sl].tolist() for sl in minis]
    greedy = [len(token_runs(r, cfg.actor.micro_batch_size, 60, True)) for r in rows]
    plan = micro_plan(cfg, lengths, minis, cfg.actor.micro_batch_size)
    Path(os.environ["SPMD_RL_OUT"], f"plan{rank}.json").write_text(
        json.dumps(
            {
                "greedy": greedy,
                "plan": [[[s.start, s.stop] for s in mini] for mini in plan],
                "minis": [[sl.start, sl.stop] for sl in minis],
                "lengths": LENGTHS[rank],
            }
        )
    )


if __name__ == "__main__":
    exit_after(main)
