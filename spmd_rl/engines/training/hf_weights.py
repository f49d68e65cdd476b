"""Build an HF causal LM sharded from the start: parameters on the meta device, parallelize
(TP + FSDP2), allocate only this rank's shards, then fill them from the folder's safetensors.

Invariant (memory): the peak host/device memory of a rank during the build is its shards
(about full / (dp_shard * tp)) plus the largest single tensor of the checkpoint, read with
plain file reads (no mmap, so nothing else of the file becomes resident). The old path,
``from_pretrained(...).to(device)`` then shard, held the whole model on every rank.

Invariant (values): every parameter equals the checkpoint's tensor (cast to the master
dtype) under the DTensor layout, i.e. ``p.full_tensor() == file[name]``; tied parameters are
filled once; a parameter missing from the files is an error naming it and the folder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from spmd_rl.data.files import safetensors_header
from spmd_rl.engines.training import fused_experts

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFolder:
    """The tensors of a folder's ``*.safetensors`` files, read one at a time with plain reads."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors files in {self.folder}: the model folder must hold HF safetensors weights"
            )
        self.index: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        for f in files:
            try:
                base, header = safetensors_header(f)
            except ValueError as exc:
                raise ValueError(f"{f}: {exc}; re-copy or re-export the weights") from None
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                dtype = SAFETENSORS_DTYPES.get(meta.get("dtype")) if isinstance(meta, dict) else None
                if dtype is None:
                    raise ValueError(f"{f}: tensor {name!r} has an unsupported dtype entry {meta!r}")
                a, b = meta["data_offsets"]
                self.index[name] = (f, dtype, tuple(int(d) for d in meta["shape"]), base + a, base + b)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def read(self, name: str) -> torch.Tensor:
        f, dtype, shape, a, b = self.index[name]
        out = torch.empty(shape, dtype=dtype)
        raw = out.reshape(-1).view(torch.uint8)
        if raw.numel() != b - a:
            raise ValueError(f"{f}: tensor {name!r} declares shape {list(shape)} but {b - a} bytes")
        with open(f, "rb") as fh:
            fh.seek(a)
            if fh.readinto(memoryview(raw.numpy())) != b - a:
                raise ValueError(f"{f}: tensor {name!r} is cut short; re-copy the weights")
        return out


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory) and keep
    their buffers real (rotary frequencies are computed at construction)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


HEADS = {
    "lm": AutoModelForCausalLM,
    "value": AutoModelForTokenClassification,
    "score": AutoModelForSequenceClassification,
}
"""The three model kinds an engine serves: a causal LM (actor, reference), a per-token scalar
head on the trunk (critic) and a pooled sequence score (reward model)."""

NEW_HEAD = "score."
"""The value head's parameters: absent from a causal LM's folder (the critic starts from the
actor's trunk), they start at zero, so every first value is 0."""


def attention_for(device: torch.device) -> str:
    """HF attention implementation: flash-attn 2 on CUDA where it is installed (its varlen
    kernel serves packed micro-batches, ``engines.fsdp.packing``), else SDPA."""
    import importlib.util

    return "flash_attention_2" if device.type == "cuda" and importlib.util.find_spec("flash_attn") else "sdpa"


def build_sharded(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    shard: Callable[[nn.Module], nn.Module],
    head: str = "lm",
    fresh: Callable[[str], bool] | None = None,
) -> nn.Module:
    """The model of ``path`` in ``dtype``, parallelized by ``shard`` while still on the meta
    device, then materialised on ``device`` holding only this rank's shards of the weights.
    ``head: value`` has one label and no dropout (its output must not depend on the rank).
    Parameters ``fresh(name)`` names (LoRA adapters ``shard`` added) are left for the caller to
    initialise."""
    config = AutoConfig.from_pretrained(path)
    if head == "value":
        config.num_labels, config.classifier_dropout = 1, 0.0
    with parameters_on_meta():
        model = HEADS[head].from_config(config, dtype=dtype, attn_implementation=attention_for(device))
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model = shard(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
        load_shards(model, SafetensorsFolder(path), zero_missing=NEW_HEAD if head == "value" else None, fresh=fresh)
    return model


@torch.no_grad()
def load_shards(
    model: nn.Module,
    weights: SafetensorsFolder,
    zero_missing: str | None = None,
    fresh: Callable[[str], bool] | None = None,
) -> None:
    """Fill every parameter's local shard from ``weights``, one checkpoint tensor at a time;
    parameters named ``zero_missing*`` that the folder lacks are zeroed, those ``fresh`` names
    are skipped."""
    for name, p in model.named_parameters():  # tied parameters are listed once
        if fresh is not None and fresh(name):
            continue
        if zero_missing and name.startswith(zero_missing) and name not in weights:
            (p.to_local() if isinstance(p, DTensor) else p).zero_()
            continue
        sources = fused_experts.checkpoint_names(name, p.shape[0])  # MoE experts: fused in memory, one by one on disk
        if any(n not in weights for n in sources):
            raise ValueError(
                f"parameter {name!r} of the model is not in {weights.folder}/*.safetensors "
                f"(looked for {sources[0]!r}); is the folder a checkpoint of this architecture?"
            )
        full = fused_experts.read(weights.read, name, p.shape[0]).to(dtype=p.dtype)
        if tuple(full.shape) != tuple(p.shape):
            raise ValueError(
                f"{weights.folder}: {name!r} has shape {list(full.shape)}, the model expects {list(p.shape)}"
            )
        if isinstance(p, DTensor):
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)
        del full
