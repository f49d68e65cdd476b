"""Multi-turn rollouts through the whole trainer (real torchrun with 2 ranks, etcd, vLLM):

- the tool quickstart (``configs/quickstart_tools.yaml``) raises held-out greedy accuracy by at
  least 45 points in 10 iterations with the calculator, where the same model and config without it cannot;
- the turn fields act (``rollout.max_turns``, ``rollout.tool_timeout_s``, a user's
  ``module:function`` environment): colocated with PPO, fused with a generation group of 2 TP
  ranks (only the first runs the tools, ``envs.turn_sync``), separated, and under partial
  rollout; and the
  trainer's log-probs at the sampled tokens equal vLLM's (float32): an update that trained the
  inserted tool tokens would show their whole log-prob as mismatch;
- a worker SIGKILLed while trajectories are inside their tool turns: the iteration is redone
  and the prompt ledger holds every prompt once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.trainer.ledger import PromptLedger, problems
from tests.conftest import REPO, subprocess_env
from tests.torchrun_util import preloaded_copies, OwnShm, kill_tree, workers_of
from tests.trainer_util import train

TOOLS = "configs/quickstart_tools.yaml"
ITERS = 10
# held-out accuracy with the calculator (AVX512 EPYC, committed warm start: tool-call rate 0.31,
# copy accuracy 0.99) 0.135, 0.705, 0.945 at iterations 0, 5, 10; without it 0.0 throughout. A
# warm start that cannot copy the tool's answer (copy accuracy 0.325) went 0.035, 0.135, 0.235.
GAIN = 0.45
HELD_OUT = 200  # the margin is over 7 standard errors at this size
ECHO = ("rollout.environment=tests.helpers.envs:echo", "rollout.max_response_length=48")


@pytest.mark.slow
def test_the_calculator_raises_held_out_accuracy_where_the_model_alone_cannot(tiny_tools, tmp_path, etcd):
    """Each run's own evaluator scores the first HELD_OUT test prompts greedily (64 tokens, 2
    turns, as the config says) before iteration 0 (the warm-started model, with and without the
    calculator) and after the last update (``final_eval_accuracy``)."""
    full = (
        "data.global_batch_size=16",
        "rollout.n=8",
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=32",
        f"trainer.iterations={ITERS}",
        "checkpoint.interval=0",
        f"eval.interval={ITERS}",
        f"eval.limit={HELD_OUT}",
    )
    tool = train(tmp_path, "tool", etcd.endpoint, *full, config=TOOLS)
    no_tool = tmp_path / "no_tool.yaml"  # the same config without the environment and its fields
    no_tool.write_text(
        "".join(
            line
            for line in (REPO / TOOLS).read_text().splitlines(keepends=True)
            if not line.strip().startswith(("environment:", "max_turns:", "tool_timeout_s:"))
        )
    )
    alone = train(tmp_path, "no_tool", etcd.endpoint, *full, config=str(no_tool))
    start_tool, final_tool = tool[0]["eval_accuracy"], tool[-1]["final_eval_accuracy"]
    start_alone, final_alone = alone[0]["eval_accuracy"], alone[-1]["final_eval_accuracy"]
    assert tool[0]["tool_calls"] > 0 and not alone[0].get("tool_calls", 0)  # the calculator acted in one run only
    print(
        f"held-out greedy accuracy over {ITERS} iterations: with the calculator {start_tool:.3f} -> {final_tool:.3f}, "
        f"without it {start_alone:.3f} -> {final_alone:.3f}"
    )
    assert final_tool - start_tool >= GAIN, (start_tool, final_tool)
    assert final_alone - start_alone < GAIN and final_tool - final_alone >= GAIN, (start_alone, final_alone, final_tool)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated-ppo", "fused-tp2", "separated", "partial"])
def test_turn_fields_act_and_only_sampled_tokens_are_trained(tiny_model, tmp_path, etcd, mode):
    extra = {  # PPO with the KL in the reward: the reference, old-log-prob, value and GAE passes all read the mask
        "colocated-ppo": [
            "algorithm.name=ppo",
            "algorithm.critic_lr=1e-4",
            "algorithm.kl_coef=0.01",
            "algorithm.use_kl_loss=false",
        ],
        # stage fusion, and one generation group of 2 TP ranks: only the first steps the tool (50 ms),
        # both submit each next turn at the same engine step (envs.turn_sync)
        "fused-tp2": ["stream.fuse=true", "parallel.gen.tp=2", "parallel.gen.dp=1"],
        "separated": [
            "parallel.placement=separated",
            "parallel.gen_ranks=1",
            "parallel.gen.dp=1",
            "parallel.train.dp_shard=1",
            "actor.correction.tis_cap=2.0",
        ],
        # 4 sampled tokens per iteration: trajectories pause mid-turn and between turns, and
        # continue on whichever generation group the dock deals them to (rebuilt from the dock)
        "partial": ["stream.partial_tokens=4", "actor.correction.tis_cap=2.0", "trainer.iterations=6"],
    }[mode]
    rows = train(
        tmp_path,
        mode,
        etcd.endpoint,
        *ECHO,
        "rollout.max_turns=2",
        *extra,
        extra_env={"SPMD_RL_TEST_TOOL_SLEEP": "0.05"} if mode == "fused-tp2" else None,
    )
    if mode == "partial":
        assert (
            sum(r["partial_carried_groups"] > 0 for r in rows) >= 3
            and sum(r["partial_trained_groups"] for r in rows) > 0
        ), rows
        rows = [r for r in rows if r["trajectories"] > 0]
        # an iteration may finish only one or two trajectories; where none got an observation,
        # each tool call ended its trajectory (no room left for the observation: a truncation)
        for r in rows:
            assert r["inserted_tokens"] > 0 or (
                r["turns_mean"] == 1.0 and r["truncations"] + r["prefix_breaks"] >= r["tool_calls"]
            ), r
        trajectories = sum(r["trajectories"] for r in rows)
        rows = [
            {
                k: sum(r[k] for r in rows)
                for k in ("tool_calls", "inserted_tokens", "tool_errors", "tool_timeouts", "prefix_breaks")
            }
            | {"turns_mean": sum(r["turns_mean"] * r["trajectories"] for r in rows) / trajectories}
        ]
    for r in rows:
        assert r["tool_calls"] > 0 and r["inserted_tokens"] > 0, r
        assert 1.0 < r["turns_mean"] <= 2.0, r  # a trajectory that called the tool got its observation and answered
        assert r["tool_errors"] == 0 and r["tool_timeouts"] == 0, r
        # a turn that stopped on <|endoftext|> (a stop token the template never renders) is a true prefix break
        assert r["prefix_breaks"] <= 0.1 * r["tool_calls"], r
        if mode in (
            "colocated-ppo",
            "fused-tp2",
        ):  # float32, on-policy: the trainer's log-prob of every trained token is vLLM's
            # float32 vLLM vs trainer, ~1e-5 per position (test_multi_turn: < 2e-4); 1e-3 over the run's iterations
            assert r["logprob_mismatch_max"] < 1e-3, r
    if (
        mode == "colocated-ppo"
    ):  # one turn at most: every observation is cut by the turn limit; a slow tool by its timeout
        rows = train(
            tmp_path,
            "one_turn",
            etcd.endpoint,
            *ECHO,
            "rollout.max_turns=1",
            "rollout.tool_timeout_s=0.5",
            extra_env={"SPMD_RL_TEST_TOOL_SLEEP": "3"},
        )
        for r in rows:
            assert r["turns_mean"] == 1.0 and r["tool_calls"] > 0, r
            assert r["tool_timeouts"] == r["tool_calls"] and r["truncations"] >= r["tool_calls"], r


@pytest.mark.slow
def test_sigkill_inside_a_multi_turn_rollout_trains_every_prompt_once(tiny_model, tmp_path, etcd):
    iters, after, job = 5, 2, "crash-multi-turn"
    mark = tmp_path / "in_tool"
    mark.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "spmd_rl.cli",
        "train",
        "configs/quickstart.yaml",
        f"checkpoint.dir={tmp_path}/ckpt",
        f"logging.dir={tmp_path}/logs",
        f"trainer.iterations={iters}",
        "data.global_batch_size=8",
        "rollout.n=4",
        "actor.mini_batch_size=8",
        "actor.micro_batch_size=8",
        *ECHO,
        "checkpoint.interval=1",
        "checkpoint.keep=10",
        f"metadata.job={job}",
        "dock.port=0",
        "logging.progress=false",
        "elastic.max_restarts=3",
    ]
    env = subprocess_env() | {
        "SPMD_RL_ETCD": etcd.endpoint,
        "OMP_NUM_THREADS": "1",
        "SPMD_RL_JOB_TOKEN": "crash-mt-token-0123456789",
        "SPMD_RL_TEST_MARK": str(mark),
        "SPMD_RL_TEST_TOOL_SLEEP": "0.2",
    }
    saved = tmp_path / f"ckpt/iter_{after:06d}"
    with OwnShm(), open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and proc.poll() is None and not saved.is_dir():
                time.sleep(0.05)
            for f in mark.iterdir():
                f.unlink()
            while time.monotonic() < deadline and proc.poll() is None and not any(mark.iterdir()):
                time.sleep(0.01)  # the next iteration's trajectories are inside their tool turns
            inside = [int(f.name) for f in mark.iterdir()]
            ranks = set(workers_of(proc.pid)) | {int(line.split()[0]) for line in preloaded_copies()}  # or their copies
            victims = [p for p in inside if p in ranks]
            assert victims, f"no worker inside a tool turn ({inside} vs {ranks})"
            os.kill(victims[0], signal.SIGKILL)
            assert proc.wait(timeout=480) == 0, (tmp_path / "run.log").read_text()[-4000:]
        finally:
            kill_tree(proc)
    assert "resumed from" in (tmp_path / "run.log").read_text()
    records = PromptLedger(MetadataStore([etcd.endpoint], job=f"{job}.ledger")).read()
    assert [r.iteration for r in records] == list(range(iters))
    assert problems(records) == []
    trained = [row for r in records for row in r.trained]
    assert len(trained) == iters * 8 and len(set(trained)) == len(trained)
