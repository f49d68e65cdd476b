"""``spmd-rl export`` of a full model: shards of at most the asked size with HF's index, in the
run's dtype, the HF names on disk (experts one by one, no tied head), read back by transformers
itself to the checkpoint's weights cast once. The checkpoints are written here with DCP as the
FSDP engine writes them (``model`` and ``optim`` sections)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from spmd_rl.trainer.export import INDEX, export

REPO = Path(__file__).resolve().parents[2]


def _checkpoint(folder: Path, model_dir: Path, dtype: str) -> dict[str, torch.Tensor]:
    """A checkpoint of ``model_dir``'s weights (float32 masters, optimizer moments beside them)
    with a trainer state naming the run's ``model.dtype``; returns the weights."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = {n: p.detach().clone() + 0.001 for n, p in model.named_parameters()}  # not the base's
    dcp.save(
        {"model": weights, "optim": {f"{n}.exp_avg": torch.ones_like(p) for n, p in weights.items()}},
        storage_writer=dcp.FileSystemWriter(str(folder)),
        no_dist=True,
    )
    state = {"iteration": 1, "model_path": str(model_dir), "tokenizer_path": str(model_dir)}
    (folder / "trainer_state.json").write_text(json.dumps(state | {"config": {"model": {"dtype": dtype}}}))
    return weights


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_bf16_run_exports_bf16_shards_with_an_index_half_the_float32_bytes(tmp_path):
    weights = _checkpoint(tmp_path / "ckpt", REPO / "assets/tiny-qwen2", "bfloat16")
    half = export(tmp_path / "ckpt", tmp_path / "bf16", max_shard_bytes=1_000_000)
    full = export(tmp_path / "ckpt", tmp_path / "f32", dtype="float32", max_shard_bytes=10**9)
    files = sorted(half.glob("*.safetensors"))
    index = json.loads((half / INDEX).read_text())
    assert len(files) >= 2 and set(index["weight_map"].values()) == {f.name for f in files}
    assert all(f.stat().st_size <= 1_000_000 + 20_000 for f in files)  # each at most a shard plus its header
    assert not (full / INDEX).exists() and (full / "model.safetensors").is_file()  # one file: no index
    stored = sum(f.stat().st_size for f in files)
    # the tensors' bytes halve exactly; the headers are a few kB of the 3.6 MB
    assert stored / (full / "model.safetensors").stat().st_size == pytest.approx(0.5, abs=0.01)
    assert index["metadata"]["total_size"] == sum(2 * w.numel() for n, w in weights.items() if n != "lm_head.weight")
    back = AutoModelForCausalLM.from_pretrained(half)
    assert back.dtype == torch.bfloat16 and json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    for name, p in back.named_parameters():
        assert torch.equal(p, weights[name].to(torch.bfloat16)), name  # cast once, nothing else
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()  # the tie kept


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fused_experts_are_written_one_by_one_and_read_back_fused(tmp_path):
    weights = _checkpoint(tmp_path / "ckpt", REPO / "assets/tiny-qwen3-moe", "float32")
    out = export(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=400_000)
    names = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as g:
            names |= set(g.keys())
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names and not any("gate_up_proj" in n for n in names)
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, p in back.named_parameters():
        assert torch.equal(p, weights[name]), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    _checkpoint(tmp_path / "ckpt", REPO / "assets/tiny-qwen2", "float32")
    state = json.loads((tmp_path / "ckpt/trainer_state.json").read_text())
    state["model_path"] = str(REPO / "assets/tiny-qwen3-moe")
    (tmp_path / "ckpt/trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(
        ValueError, match=r"does not match the base model: missing \[.model.layers.0.mlp.experts.0.down_proj.weight"
    ):
        export(tmp_path / "ckpt", tmp_path / "hf")
