"""Generation skew between DP groups does not kill a run: the collectives that follow
generation (the eval sum, partial rollout's count of finished groups) run under
``elastic.startup_timeout_s``, not the iteration's ``elastic.collective_timeout_s``
(``distributed.timeouts.generation_phase``).

Rank 1's every generation call sleeps longer than the collective timeout
(``tests/helpers/faults``, kind "slow_generate"), in partial-rollout mode with an eval every
iteration. Under the old timeouts rank 0 timed out in the eval sum and torchrun restarted the
group until it gave up; here the run finishes on its first attempt."""

from __future__ import annotations

import json

import pytest

from tests.trainer_util import train

SLOW_S, TIMEOUT_S = 15, 10
"""Generation sleeps 1.5x the collective timeout; the timeout leaves room for ranks that drift
apart by seconds where two pytest-xdist workers share two slow cores (it was 3 s)."""


@pytest.mark.slow
def test_generation_slower_than_the_collective_timeout_finishes_without_a_restart(tiny_model, tmp_path, etcd):
    env = {"SPMD_RL_TEST_FAULTS": json.dumps({"kind": "slow_generate", "rank": 1, "seconds": SLOW_S})}
    rows = train(
        tmp_path,
        "skew",
        etcd.endpoint,
        f"elastic.collective_timeout_s={TIMEOUT_S}",
        "elastic.max_restarts=0",
        "trainer.iterations=1",
        "eval.interval=1",
        "eval.limit=4",
        "stream.partial_tokens=4",
        "actor.correction.tis_cap=2.0",
        "checkpoint.interval=0",
        extra_env=env,
    )
    assert [r["iteration"] for r in rows] == [0]
    assert all(r["time_eval"] > SLOW_S for r in rows)  # the delay did land inside the eval
    assert all("eval_accuracy" in r for r in rows)
