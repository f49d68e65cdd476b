"""The tiny Qwen3-MoE against its own HF files: the parameter inventory ``plan`` and ``validate``
use lists exactly the checkpoint's tensors, and the fused in-memory expert layout
(``engines.training.fused_experts``) is read from and split back into the checkpoint's per-expert
tensors bit for bit, equal to what transformers itself loads."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from spmd_rl.config.model_arch import ModelArch
from spmd_rl.engines.training import fused_experts
from spmd_rl.engines.training.hf_weights import SafetensorsFolder


def test_the_inventory_is_the_checkpoint(tiny_moe):
    arch, folder = ModelArch.from_folder(tiny_moe), SafetensorsFolder(tiny_moe)
    assert arch.is_moe and arch.num_experts == 4 and arch.experts_per_token == 2 and arch.sparse_layers == (0, 1, 2, 3)
    listed = {t.name: t.numel for t in arch.tensors()}
    assert listed == {n: int(torch.Size(meta[2]).numel()) for n, meta in folder.index.items()}
    assert arch.expert_numel() == 4 * 4 * 3 * 192 * 128  # layers x experts x (gate, up, down) x I x H
    assert not any(t.expert for t in arch.tensors() if ".experts." not in t.name)


def test_fused_experts_round_trip_through_the_checkpoint_names(tiny_moe):
    folder = SafetensorsFolder(tiny_moe)
    hf = dict(AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).named_parameters())
    fused = [n for n in hf if fused_experts.is_fused(n)]
    assert len(fused) == 8  # gate_up_proj and down_proj of 4 layers
    for name, p in hf.items():
        ours = fused_experts.read(folder.read, name, p.shape[0])
        assert torch.equal(ours, p.detach()), name  # what transformers' own conversion loads
        pieces = list(fused_experts.split(name, ours))
        assert all(torch.equal(t, folder.read(n)) for n, t in pieces), name
        assert [(n, list(t.shape)) for n, t in pieces] == fused_experts.split_shape(name, list(p.shape))
    assert (
        sum(len(list(fused_experts.split(n, p))) for n, p in hf.items()) == len(folder.index) - 0
    )  # tied head: one tensor
