"""actor.accumulate_unsharded on 2 real ranks (FSDP over both): the same steps as the plain
engine, with one parameter all-gather per FSDP module per optimizer step (none per
micro-batch, in forward or backward), and forward-only passes afterwards reshard after each
module again (as many all-gathers as the plain engine's)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO
from tests.torchrun_util import QUIET_CHILD_ENV, run_nodes


@pytest.mark.slow
def test_accumulate_unsharded_gathers_once_per_step_and_keeps_the_step(tiny_model, tmp_path):
    env = QUIET_CHILD_ENV | {"MODEL": str(tiny_model), "SPMD_RL_OUT": str(tmp_path)}
    run_nodes(
        REPO / "tests/helpers/accumulate_worker.py",
        nnodes=1,
        nproc_per_node=2,
        env=env,
        log_dir=tmp_path,
        timeout_s=300,
    )
    for rank in range(2):
        r = json.loads((tmp_path / f"accumulate-rank{rank}.json").read_text())
        plain, accum = r["plain"], r["accumulate"]
        for a, b in zip(plain["steps"], accum["steps"]):
            # float32: 3 micro-batches x 2 ranks reduced per micro-batch or once, other sum orders: rel ~1e-7 / ~1e-6
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(
                b["grad_norm"], rel=1e-5
            )
        assert plain["logprobs"] == pytest.approx(accum["logprobs"], rel=1e-6)  # fp32 sums in another order
        assert accum["step_gathers"] == accum["fsdp_modules"] == 5  # 4 decoder layers + the root
        assert plain["step_gathers"] >= 3 * accum["fsdp_modules"]  # three micro-batches, each gathers again
        assert accum["infer_gathers"] == plain["infer_gathers"] == 2 * accum["fsdp_modules"]
