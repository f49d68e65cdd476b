"""Tensor-parallel plans per architecture and FSDP2 wrapping (after torchtitan's parallelize.py).

Qwen2, Qwen3 and Llama decoder layers share one plan: q/k/v and gate/up are column-parallel,
o and down row-parallel (Megatron pairing, one all-reduce per block). HF attention reshapes
with ``-1`` heads, so local heads follow from the local q/k/v widths. Embedding, norms and LM
head stay replicated over TP and are sharded by FSDP over ``dp_shard``.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

DECODER_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}
PLANS = {"qwen2": DECODER_PLAN, "qwen3": DECODER_PLAN, "llama": DECODER_PLAN}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    model_type = model.config.model_type
    if model_type not in PLANS:
        raise ValueError(f"no tensor-parallel plan for model_type {model_type!r}; supported: {', '.join(PLANS)}")
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, PLANS[model_type])


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, mp: MixedPrecisionPolicy | None = None) -> None:
    """One FSDP unit per decoder layer, then the root (embedding, final norm, LM head together,
    so tied embeddings stay one parameter). Under mixed precision every unit computes in the
    low dtype, the LM head too, as vLLM's does: in float32 it was the costliest matmul per
    response token (hidden x vocab) and saved float32 logits for backward. Its logits are cast
    to float32 chunk by chunk inside the fused log-prob kernel (``engines.training.token_logprob``), so
    the log-softmax, entropy and every reduction stay float32."""
    kw = {"mesh": dp_mesh, "reshard_after_forward": True, **({"mp_policy": mp} if mp is not None else {})}
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)


def apply_compile(model: nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (dynamic shapes: micro-batches are trimmed to
    their own length). Identical layers share one compiled graph; FSDP's hooks stay outside it."""
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)


def parallelize(
    model: nn.Module,
    train_mesh: DeviceMesh,
    mp: MixedPrecisionPolicy | None = None,
    checkpointing: bool = False,
    compile: bool = False,
) -> nn.Module:
    if train_mesh["tp"].size() > 1:
        apply_tp(model, train_mesh["tp"])
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile:
        apply_compile(model)
    apply_fsdp(model, train_mesh["dp_shard"], mp)
    return model
