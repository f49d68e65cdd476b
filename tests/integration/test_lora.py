"""LoRA (``engines.training.lora``): the layer against its formula in float64, the injection's errors,
and a LoRA actor under torchrun against HF forwards and vLLM (``helpers/lora_worker.py``)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from spmd_rl.engines.training import lora
from tests.conftest import REPO
from tests.torchrun_util import QUIET_CHILD_ENV, run_nodes


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(6, 5, bias=True)
        self.down_proj = nn.Linear(5, 3, bias=False)
        self.norm = nn.LayerNorm(3)


def adapted(seed=0, rank=2, alpha=3.0, dropout=0.0, targets=("q_proj", "down_proj")):
    torch.manual_seed(seed)
    m = Block().double()
    names = lora.inject(m, rank, alpha, dropout, list(targets), torch.float64)
    lora.init_adapters(m, seed=1)
    return m, names


def test_lora_linear_is_the_formula_in_float64():
    m, names = adapted()
    assert names == ["q_proj", "down_proj"]
    with torch.no_grad():  # B starts at 0: the layer is the base layer
        x = torch.randn(4, 6, dtype=torch.float64)
        assert torch.equal(m.q_proj(x), x @ m.q_proj.weight.T + m.q_proj.bias)
        m.q_proj.lora_B.normal_()
        a, b, w = m.q_proj.lora_A, m.q_proj.lora_B, m.q_proj.weight
        want = x @ w.T + m.q_proj.bias + (3.0 / 2) * (x @ a.T) @ b.T
        # float64: the same products in another association, |y| ~ 10 x eps 2.2e-16 x 6 terms
        assert torch.allclose(m.q_proj(x), want, atol=1e-12, rtol=0)
        merged = w + lora.merge_deltas(m)["q_proj.weight"].double()
        assert torch.allclose(x @ merged.T + m.q_proj.bias, want, atol=1e-6, rtol=0)  # merge_deltas is float32
        with lora.adapters_off(m):
            assert torch.equal(m.q_proj(x), x @ w.T + m.q_proj.bias)
        assert m.q_proj.enabled


def test_only_adapters_train_and_init_is_seeded():
    m, _ = adapted()
    trainable = sorted(n for n, p in m.named_parameters() if p.requires_grad)
    assert trainable == ["down_proj.lora_A", "down_proj.lora_B", "q_proj.lora_A", "q_proj.lora_B"]
    assert m.q_proj.lora_A.shape == (2, 6) and m.q_proj.lora_B.shape == (5, 2) and not m.q_proj.lora_B.any()
    bound = 1 / 6**0.5
    assert m.q_proj.lora_A.abs().max() <= bound and m.q_proj.lora_A.abs().max() > bound / 2
    other, _ = adapted(seed=5)  # another model init, the same adapter seed: the same adapters
    assert torch.equal(other.q_proj.lora_A, m.q_proj.lora_A)


def test_dropout_acts_in_training_only():
    m, _ = adapted(dropout=0.5)
    with torch.no_grad():
        m.q_proj.lora_B.normal_()
    x = torch.randn(64, 6, dtype=torch.float64)
    m.eval()
    assert torch.equal(m.q_proj(x), m.q_proj(x))
    m.train()
    torch.manual_seed(0)
    # dropout 0.5 changes the adapter term by O(1), far outside allclose's default
    assert not torch.allclose(m.q_proj(x), m.eval().q_proj(x))


def test_a_target_naming_no_linear_layer_is_refused():
    with pytest.raises(ValueError, match=r"actor.lora.target_modules: \['o_proj', 'norm'\].*\['down_proj', 'q_proj'\]"):
        lora.inject(Block(), 2, 4.0, 0.0, ["q_proj", "o_proj", "norm"], torch.float32)


def test_peft_names():
    assert (
        lora.peft_name("model.layers.0.self_attn.q_proj.lora_A")
        == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    )
    cfg = lora.peft_config("/m", 8, 16.0, 0.0, ["v_proj", "q_proj"])
    assert (
        cfg["r"] == 8
        and cfg["lora_alpha"] == 16.0
        and cfg["target_modules"] == ["q_proj", "v_proj"]
        and cfg["peft_type"] == "LORA"
    )


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_lora_actor_under_torchrun(tmp_path, tiny_model, sync):
    env = QUIET_CHILD_ENV | {"MODEL": str(tiny_model), "SPMD_RL_OUT": str(tmp_path), "LORA_SYNC": sync}
    run_nodes(
        REPO / "tests/helpers/lora_worker.py", nnodes=1, nproc_per_node=2, env=env, log_dir=tmp_path, timeout_s=600
    )
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # float32: the FSDP engine vs HF's forward in other batch shapes (~1e-6); B = 0 adds exact zeros
        assert r["initial_vs_base"] < 1e-5  # B = 0: the adapted model starts as the base model
        assert r["adapted_moved"] > 0.1  # three updates moved the policy
        # float32: the engine with adapters off vs HF's forward in other batch shapes (~1e-6)
        assert r["reference_vs_base"] < 1e-5  # adapters off == the HF base model: the reference
        assert r["reference_reads_actor_tensors"] > 1e-3  # ... computed from the actor's own tensors, not a copy
        assert r["base_frozen_bit_exact"]  # the base weights never moved
        assert (
            # float32: merged W + s B A (one more rounding) through HF vs the engine's adapted forward, other shapes
            r["synced_names_are_checkpoint_names"] and r["merged_vs_adapted"] < 1e-4
        )  # merged weights are the trained policy
        # float32: vLLM's CPU forward vs the trainer's, each ~1e-5 from float64; 1e-4 ~7x
        assert max(r["vllm_vs_trainer"]) < 1e-4  # after each of two syncs vLLM samples from the trainer's policy
        if sync == "adapter":  # the base weights went to vLLM once; then only adapters, a new version per sync
            assert r["synced_is_base"] and r["full_weight_loads"] == 1 and r["adapter_versions"] == 2
        else:  # the merged weights every time
            assert not r["synced_is_base"] and r["full_weight_loads"] == 2 and r["adapter_versions"] == 0
        print(f"{sync} sync (gather + load + first generation), rank {rank}: {r['sync_s']}")
        assert r["adapted_layers"] == 4 * r["decoder_layers"]  # every targeted projection of every layer
        assert r["optimizer_local_numel"] == 2 * r["adapter_local_numel"]  # AdamW over the adapters, nothing else
        assert 2 * r["adapter_local_numel"] == r["adapter_full_numel"]  # FSDP shards the adapters over DP 2
        assert r["saved_model_keys_are_adapters"] and r["resumed_vs_saved"] == 0.0


def test_plan_counts_the_adapters_and_the_state_lora_saves(tiny_model):
    """The plan's LoRA training state: the frozen base in model.dtype plus adapters with two AdamW
    states, against full fine-tuning's float32 masters and states (rank 16 on every projection)."""
    from spmd_rl.recipe.estimates import lora_numels
    from spmd_rl.recipe.train_backends import rank_memory
    from spmd_rl.config.layout import Layout, Layouts
    from spmd_rl.config.loader import load_config
    from spmd_rl.config.model_arch import ModelArch
    from spmd_rl.recipe.plan import memory_lines

    cfg = load_config(
        REPO / "configs/quickstart.yaml", [f"model.path={tiny_model}", "actor.lora.rank=16", "model.dtype=bfloat16"]
    )
    arch, lay = ModelArch.from_folder(tiny_model), Layouts(2, 2, Layout(2, 1), Layout(2, 1))
    adapters = lora_numels(arch, 16, cfg.actor.lora.target_modules)
    h, f = arch.hidden_size, arch.intermediate_size
    assert adapters[-2:] == [16 * f, h * 16]  # down_proj of the last layer: A [16, f], B [h, 16]
    mem = rank_memory(cfg, arch, lay)
    local = sum(-(-n // 2) for n in adapters)
    assert mem.train_grads == 4 * local and mem.train_optim == 8 * local
    base = sum(-(-t.numel // 2) for t in arch.tensors())
    assert mem.train_params == 2 * base + 4 * local  # bfloat16 base, float32 adapters
    text = "\n".join(memory_lines(cfg, arch, lay))
    assert f"{sum(adapters) / 1e6:.3f} M adapter parameters" in text and "full fine-tuning would hold" in text


@pytest.mark.parametrize(
    "overrides,why",
    [
        (
            ["parallel.placement=separated", "parallel.gen_ranks=1", "parallel.gen.dp=1", "parallel.train.dp_shard=1"],
            "by broadcast",
        ),
        (["actor.lora.rank=1024"], "up to 512"),
        (["model.path=assets/tiny-qwen3-moe", "actor.lora.target_modules=[q_proj]"], "dense models"),
    ],
)
def test_adapter_sync_is_refused_where_it_does_not_run_and_merged_is_not(tiny_model, tiny_moe, overrides, why):
    from spmd_rl.config.loader import load_config
    from spmd_rl.recipe.rules import check

    cfg = load_config(REPO / "configs/quickstart.yaml", [f"model.path={tiny_model}", "actor.lora.rank=8", *overrides])
    _, violations = check(cfg, 2, 2)
    assert [(v.field, why in v.problem) for v in violations if v.field.startswith("actor.lora")] == [
        ("actor.lora.sync", True)
    ], violations
    merged = load_config(
        REPO / "configs/quickstart.yaml",
        [f"model.path={tiny_model}", "actor.lora.rank=8", *overrides, "actor.lora.sync=merged"],
    )
    assert not [v for v in check(merged, 2, 2)[1] if v.field.startswith("actor.lora")]
