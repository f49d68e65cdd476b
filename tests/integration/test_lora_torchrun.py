"""LoRA RL through ``spmd-rl train`` (real torchrun, etcd, vLLM): the reference is the base model
(the KL to it starts at 0 and grows as the adapters train), checkpoints hold the adapters only,
and ``spmd-rl export`` writes a PEFT adapter folder that PEFT itself reads back to the same
model as ``--merged``; the plan predicts the adapters' size the engine built."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from spmd_rl.recipe.estimates import lora_numels
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.engines.training.safe_dcp import verify
from tests.conftest import REPO, subprocess_env
from tests.trainer_util import train

LORA = (
    "actor.lora.rank=8",
    "actor.lora.alpha=16",
    "actor.lora.target_modules=[q_proj,v_proj,down_proj]",
    "actor.optim.lr=2e-3",
)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


@pytest.mark.slow
def test_lora_run_reference_checkpoint_and_export(tmp_path, tiny_model, etcd):
    rows = train(
        tmp_path,
        "lora",
        etcd.endpoint,
        *LORA,
        "trainer.iterations=3",
        "algorithm.use_kl_loss=true",
        "algorithm.kl_coef=0.01",
    )
    # the reference is the base model: identical to the actor before the first update (B = 0),
    # then apart as the adapters move (a reference that kept its adapters on would stay at 0)
    assert rows[0]["kl"] == 0.0 and rows[2]["kl"] > 1e-4
    # no second copy of the weights: the reference is the actor's tensors (test_lora's worker doubles one)
    layers = ModelArch.from_folder(tiny_model).num_layers  # the run says which sync ran
    assert (
        f"LoRA rank 8 alpha 16 on {3 * layers} layers (q_proj, v_proj, down_proj); weight sync: the adapters alone to "
        f"vLLM's LoRA" in (tmp_path / "lora/stderr.log").read_text()
    )
    ckpt = tmp_path / "lora/ckpt/iter_000003"
    meta = verify(ckpt).state_dict_metadata
    model_keys = [k for k in meta if k.startswith("model.")]
    assert model_keys and all(k.endswith((".lora_A", ".lora_B")) for k in model_keys)  # the base weights are not saved
    arch = ModelArch.from_folder(tiny_model)
    saved = sum(meta[k].size.numel() for k in model_keys)
    assert saved == sum(lora_numels(arch, 8, ["q_proj", "v_proj", "down_proj"]))  # the plan's count is the engine's
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["lora"]["rank"] == 8 and state["lora"]["target_modules"] == ["q_proj", "v_proj", "down_proj"]

    cli = [sys.executable, "-m", "spmd_rl.cli", "export", str(ckpt)]
    for out, extra in ((tmp_path / "adapter", []), (tmp_path / "merged", ["--merged"])):
        done = subprocess.run(
            [*cli, "--out", str(out), *extra],
            cwd=REPO,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "adapter").glob("adapter_*")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    from peft import PeftModel  # the independent reader of the adapter folder
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.tensor([[3, 17, 42, 99, 7, 250, 12, 5]])
    before = logits(base, ids)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    via_peft = logits(peft_model, ids)
    merged = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32), ids)
    assert (via_peft - before).abs().max() > 1e-3  # the adapters trained
    # float32 logits: PEFT's x W + s (x A) B vs x (W + s B A) merged, rounded apart ~1e-6 x |logit| ~ 10
    assert (via_peft - merged).abs().max() < 1e-4  # PEFT's reading of the adapters == our merge


def test_lora_is_refused_where_it_does_not_run(tmp_path):
    """tp > 1 and the megatron backend are refused with the field and the fix (exit 2)."""
    for extra, why in (
        (["parallel.train.tp=2", "parallel.train.dp_shard=1"], "no tensor-parallel plan"),
        (["actor.backend=megatron"], "LoRA runs on the FSDP backend"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "spmd_rl.cli", "validate", "configs/quickstart.yaml", "actor.lora.rank=4", *extra],
            cwd=REPO,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and "actor.lora" in done.stderr and why in done.stderr, done.stderr
