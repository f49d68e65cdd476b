"""`spmd-rl validate`: the quickstart is valid; each broken config exits 2 naming the field."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from spmd_rl.cli import app

runner = CliRunner()
QUICK = "configs/quickstart.yaml"


def run(*args: str):
    return runner.invoke(app, list(args))


def test_quickstart_is_valid(in_repo, tiny_model):
    res = run("validate", QUICK)
    assert res.exit_code == 0, res.output
    assert "train dp_shard=2 tp=1" in res.output


def test_the_tp_relay_threshold_is_accepted_where_a_tp_group_can_use_it(in_repo, tiny_model):
    res = run("validate", QUICK, "dock.tp_relay_min_bytes=0", "parallel.train.tp=2", "parallel.train.dp_shard=1")
    assert res.exit_code == 0, res.output


def test_console_script_exit_codes(in_repo, tiny_model):
    exe = [sys.executable, "-m", "spmd_rl.cli"]
    ok = subprocess.run(exe + ["validate", QUICK], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(exe + ["validate", QUICK, "rollout.n=0"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "rollout.n=0" in bad.stderr


BROKEN = [
    # (overrides, world size, field that must be named)
    (["rollout.n=0"], None, "rollout.n"),
    (["actor.optim.lr=fast"], None, "actor.optim.lr"),
    (["actor.lrr=1e-5"], None, "actor.lrr"),
    (["algorithm.name=reinforce"], None, "algorithm.name"),
    (["algorithm.name=ppo", "critic.model_path=assets/no-critic"], None, "critic.model_path"),
    (["algorithm.use_kl_loss=false"], None, "algorithm.use_kl_loss"),
    (["algorithm.gamma=0.9"], None, "algorithm.gamma"),
    (["algorithm.lam=0.9"], None, "algorithm.lam"),
    (["critic.offload_to_host=false"], None, "critic.offload_to_host"),
    (["parallel.train.dp_shard=3"], None, "parallel.train.dp_shard"),
    (["parallel.gen.tp=3"], None, "parallel.gen.tp"),
    (["data.global_batch_size=15"], None, "data.global_batch_size"),
    (["actor.mini_batch_size=5"], None, "actor.mini_batch_size"),
    (["actor.micro_batch_size=48"], None, "actor.micro_batch_size"),
    (["rollout.max_response_length=300"], None, "rollout.max_response_length"),
    (["data.train_path=assets/nope.jsonl"], None, "data.train_path"),
    (["model.path=assets/no-model"], None, "model.path"),
    (
        ["parallel.train.tp=8", "parallel.train.dp_shard=1", "parallel.gen.tp=8", "parallel.gen.dp=1"],
        8,
        "parallel.train.tp",
    ),
    (["reward.rule=no_such_pkg_xyz:score"], None, "reward.rule"),
    (["reward.kind=model"], None, "reward.model_path"),
    (["reward.kind=model", "reward.model_path=assets/tiny-qwen2"], None, "reward.model_path"),
    (["reward.rule_weight=0.5"], None, "reward.rule_weight"),
    (["reward.offload_to_host=false"], None, "reward.offload_to_host"),
    (["elastic.max_nodes=2"], None, "elastic.rdzv_endpoint"),
    (["dock.max_message_bytes=1024"], None, "dock.max_message_bytes"),
    (["dock.tp_relay_min_bytes=0"], None, "dock.tp_relay_min_bytes"),  # TP 1 on both layouts
    (
        ["dock.tp_relay_min_bytes=0", "dock.mode=centralized", "parallel.train.tp=2", "parallel.train.dp_shard=1"],
        None,
        "dock.tp_relay_min_bytes",
    ),
    (["dock.records_group_nodes=4", "dock.mode=centralized"], None, "dock.records_group_nodes"),
    (["model.tokenizer_path=assets/no-tokenizer"], None, "model.tokenizer_path"),
    (["reward.model_path=assets/tiny-qwen2"], None, "reward.model_path"),
    (["rollout.engine=nope"], None, "rollout.engine"),
    (["rollout.engine=hf", "parallel.gen.tp=2", "parallel.gen.dp=1"], None, "rollout.engine"),
    (["algorithm.critic_lr=1e-5"], None, "algorithm.critic_lr"),
    (["algorithm.value_clip=0.2"], None, "algorithm.value_clip"),
    (["reshard.prefetch=true"], None, "reshard.prefetch"),
    (["eval.interval=5", "data.test_path=null"], None, "eval.interval"),
    (["reward.rule=math:isclose", "reward.format_score=0.1"], None, "reward.format_score"),
    (["reward.format_score=0.7"], None, "reward.format_score"),
    (["algorithm.dynamic_sampling=true"], None, "algorithm.dynamic_sampling"),
    # G=2 groups over 4 training DP groups would leave two of them without work
    (
        [
            "data.global_batch_size=2",
            "actor.mini_batch_size=2",
            "actor.micro_batch_size=4",
            "parallel.train.dp_shard=4",
            "parallel.gen.tp=2",
            "parallel.gen.dp=2",
        ],
        4,
        "data.global_batch_size",
    ),
    (["rollout.temperature=0"], None, "rollout.temperature"),
    (["elastic.min_nodes=3"], None, "elastic.min_nodes"),
    (["metadata.endpoints=[localhost]"], None, "metadata.endpoints.0"),
    (["checkpoint.resume=/no/such/ckpt"], None, "checkpoint.resume"),
    (["data.train_path=assets/tiny-qwen2/train.csv"], None, "data.train_path"),
    (["dock.token=short"], None, "dock.token"),
    (["metadata.cert_file=assets/tiny-qwen2/config.json"], None, "metadata.key_file"),
    (
        ["metadata.cert_file=assets/tiny-qwen2/config.json", "metadata.key_file=assets/tiny-qwen2/config.json"],
        None,
        "metadata.ca_file",
    ),
    (["metadata.ca_file=/no/such/ca.crt"], None, "metadata.ca_file"),
    (["model"], None, "model"),
    (["actor.optim.betas=[0.9,1.5]"], None, "actor.optim.betas.1"),  # a tuple's elements are range-checked too
    (["actor.optim.betas=[-0.1,0.99]"], None, "actor.optim.betas.0"),
    (["trainer.seed=-1"], None, "trainer.seed"),
    (["reward.rule_weight=-1"], None, "reward.rule_weight"),
]


@pytest.mark.parametrize("overrides,world,field", BROKEN, ids=[b[2] + "|" + " ".join(b[0]) for b in BROKEN])
def test_broken_config_names_field(in_repo, tiny_model, overrides, world, field):
    args = ["validate", QUICK, *overrides] + (
        ["--world-size", str(world), "--nproc-per-node", str(world)] if world else []
    )
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert f"{field}=" in res.output, res.output


def test_not_implemented_field_says_why(in_repo, tiny_model):
    res = run("validate", QUICK, "reshard.prefetch=true")
    assert (
        res.exit_code == 2
        and "prefetching the training state is not implemented" in res.output
        and "remove the field" in res.output
    )


def test_all_violations_reported_at_once(in_repo, tiny_model):
    res = run("validate", QUICK, "rollout.n=0", "actor.optim.lr=-1", "data.test_path=assets/missing.jsonl")
    assert res.exit_code == 2
    # type errors stop before cross-field rules; both type errors appear together
    assert "rollout.n=0" in res.output and "actor.optim.lr=-1" in res.output
    res = run(
        "validate", QUICK, "data.global_batch_size=15", "data.test_path=assets/missing.jsonl", "rollout.temperature=0"
    )
    lines = [ln for ln in res.output.splitlines() if ln.strip().startswith("- ")]
    assert {"data.global_batch_size", "data.test_path", "rollout.temperature"} <= {ln.split("=")[0][4:] for ln in lines}


def test_missing_config_file_exit_2(in_repo):
    res = run("validate", "configs/does-not-exist.yaml")
    assert res.exit_code == 2 and "file not found" in res.output


def test_world_size_changes_derived_layout(in_repo, tiny_model):
    res = run(
        "validate",
        QUICK,
        "parallel.train.dp_shard=null",
        "parallel.gen.dp=null",
        "--world-size",
        "4",
        "--nproc-per-node",
        "2",
    )
    assert res.exit_code == 0, res.output
    assert "world 4 (2 node(s) x 2)" in res.output and "gen dp=4" in res.output


GROUP_RULES = [
    # the review's DPO case: 4 ranks, 6 pairs over 4 DP groups took [2, 2, 1, 1] optimizer steps and hung
    (
        "configs/quickstart_dpo.yaml",
        [
            "parallel.train.dp_shard=4",
            "parallel.gen.dp=2",
            "parallel.gen.tp=2",
            "data.global_batch_size=6",
            "actor.mini_batch_size=6",
            "actor.micro_batch_size=3",
        ],
        4,
        "data.global_batch_size",
    ),
    # DP 2: 3 pairs per step split 2 + 1 (it ran 3 steps of 2 pairs instead of 2 of 3)
    (
        "configs/quickstart_dpo.yaml",
        ["data.global_batch_size=6", "actor.mini_batch_size=3", "actor.micro_batch_size=2"],
        None,
        "actor.mini_batch_size",
    ),
    # REINFORCE++-baseline with fewer groups than DP ranks: a rank without a group left the advantage all-reduce
    (
        QUICK,
        [
            "algorithm.name=reinforce_pp_baseline",
            "data.global_batch_size=1",
            "actor.mini_batch_size=1",
            "actor.micro_batch_size=8",
        ],
        None,
        "data.global_batch_size",
    ),
    (
        QUICK,
        ["algorithm.name=rloo", "data.global_batch_size=3", "actor.mini_batch_size=3", "actor.micro_batch_size=4"],
        None,
        "data.global_batch_size",
    ),
]


@pytest.mark.parametrize(
    "config,overrides,world,field", GROUP_RULES, ids=["dpo-dp4-G6", "dpo-dp2-mb3", "rpp-baseline-G1", "rloo-G3"]
)
def test_every_algorithm_that_reads_a_group_gets_whole_groups_on_every_rank(
    in_repo, tiny_model, config, overrides, world, field
):
    args = ["validate", config, *overrides] + (
        ["--world-size", str(world), "--nproc-per-node", str(world)] if world else []
    )
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert f"{field}=" in res.output and "whole" in res.output, res.output


def test_icepop_beside_tis_is_refused(in_repo, tiny_model):
    """IcePop's weight is the ratio itself inside its band: with TIS the ratio would weigh twice."""
    res = run("validate", QUICK, "actor.correction.icepop_band=[0.5,2.0]", "actor.correction.tis_cap=2.0")
    assert res.exit_code == 2 and "actor.correction.tis_cap=" in res.output and "IcePop" in res.output, res.output
    assert run("validate", QUICK, "actor.correction.icepop_band=[0.5,2.0]").exit_code == 0
