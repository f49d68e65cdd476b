"""LoRA adapters on an FSDP2 actor (Hu et al. 2021), in PEFT's layout.

A targeted ``nn.Linear`` of weight W [out, in] gets A [r, in] and B [out, r] and computes

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T

with W (and b) frozen in the compute dtype and only A, B trainable (in the master dtype).
A starts Kaiming-uniform (a = sqrt 5, as PEFT and ``nn.Linear`` do), B at zero, so the first
forward equals the base model's. Invariants:

- ``adapters_off(model)``: every LoRA term is skipped, the model is the base model exactly
  (the reference policy: no second copy of the weights);
- ``merged`` weight W' = W + (alpha / r) B A: the rollout engine served W' computes the same
  function as the adapted trainer up to float rounding (``TrainEngine.full_weights``);
- adapter names are ``<linear>.lora_A`` / ``<linear>.lora_B``; PEFT's file names
  (``base_model.model.<linear>.lora_A.weight``) come from ``peft_name``.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

from spmd_rl.engines.base import Engine, LossFn

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` whose class was swapped in place (its name and weight stay the
    checkpoint's), plus the adapter pair."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scale: float
    dropout: float
    enabled: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        out = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return out + self.scale * F.linear(F.linear(h, self.lora_A.to(h.dtype)), self.lora_B.to(h.dtype))


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def inject(
    model: nn.Module, rank: int, alpha: float, dropout: float, targets: list[str], dtype: torch.dtype
) -> list[str]:
    """Turn every ``nn.Linear`` whose last name part is in ``targets`` into a LoRALinear with
    (still uninitialised) adapters in ``dtype``, freeze everything else; the names it adapted.
    A target that names no ``nn.Linear`` of the model is an error naming it."""
    model.requires_grad_(False)
    adapted, hit = [], set()
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in targets and type(mod) is nn.Linear:
            mod.__class__ = LoRALinear
            dev = mod.weight.device
            mod.lora_A = nn.Parameter(torch.empty(rank, mod.in_features, dtype=dtype, device=dev))
            mod.lora_B = nn.Parameter(torch.empty(mod.out_features, rank, dtype=dtype, device=dev))
            mod.scale, mod.dropout, mod.enabled = alpha / rank, dropout, True
            adapted.append(name)
            hit.add(leaf)
    missing = [t for t in targets if t not in hit]
    if missing:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) in (nn.Linear, LoRALinear)})
        raise ValueError(
            f"actor.lora.target_modules: {missing} name no linear layer of this model (its linear layers: {linears}); "
            "fused MoE experts are not nn.Linear and cannot be adapted"
        )
    return adapted


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform with a = sqrt 5), B = 0, drawn from one
    seeded generator in module order, so every rank and every layout holds the same adapters."""
    gen = torch.Generator().manual_seed(seed)
    for mod in lora_modules(model):
        bound = 1.0 / math.sqrt(mod.in_features)
        full_a = torch.empty(tuple(mod.lora_A.shape), dtype=torch.float32).uniform_(-bound, bound, generator=gen)
        for p, full in ((mod.lora_A, full_a), (mod.lora_B, torch.zeros(tuple(mod.lora_B.shape)))):
            full = full.to(p.dtype)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(full)


def lora_modules(model: nn.Module) -> Iterator[LoRALinear]:
    return (m for m in model.modules() if isinstance(m, LoRALinear))


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model: every LoRA term skipped inside, restored after."""
    mods = list(lora_modules(model))
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.enabled = True


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def merge_deltas(model: nn.Module) -> dict[str, torch.Tensor]:
    """{``<linear>.weight``: (alpha / r) B A} in float32, full tensors (collective over the
    mesh for sharded adapters; small: r x (in + out) per layer)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoRALinear):
            out[f"{name}.weight"] = mod.scale * (full(mod.lora_B).float() @ full(mod.lora_A).float())
    return out


def peft_name(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A`` -> PEFT's
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return f"base_model.model.{name}.weight"


def peft_config(base: str, rank: int, alpha: float, dropout: float, targets: list[str]) -> dict:
    """PEFT's ``adapter_config.json`` for these adapters."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def write_peft_folder(
    folder: Path,
    adapters: dict[str, torch.Tensor],
    base: str,
    rank: int,
    alpha: float,
    dropout: float,
    targets: list[str],
) -> None:
    """PEFT's adapter folder: ``adapter_model.safetensors`` (``peft_name`` of every
    ``<linear>.lora_A`` / ``.lora_B``) and ``adapter_config.json`` (``peft_config``)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {peft_name(n): t.detach().cpu().contiguous() for n, t in adapters.items()},
        str(folder / "adapter_model.safetensors"),
    )
    (folder / "adapter_config.json").write_text(json.dumps(peft_config(base, rank, alpha, dropout, targets), indent=1))


class BaseModelView(Engine):
    """The reference policy of a LoRA actor: the actor's own engine with every adapter off. It
    owns no memory (its tensors are the actor's; the stage graph makes the actor resident for
    the reference pass, ``recipe.graph``) and has nothing to train, sync or save."""

    trainable = False

    def __init__(self, actor: Engine):
        self.actor, self.acc = actor, actor.acc

    def infer(self, micro_batches: list, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        with adapters_off(self.actor.model):
            return self.actor.infer(micro_batches, with_entropy)

    def train_step(self, micro_batches: list, loss_fn: LossFn, with_entropy: bool = False) -> dict[str, float]:
        raise TypeError("the LoRA reference (base model with adapters off) is frozen")

    def weight_shapes(self) -> list[tuple[str, list[int]]]:
        return []

    def full_weights(self, dtype: torch.dtype, bucket_bytes: float) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        return 0, iter(())

    def param_tensors(self) -> list[torch.Tensor]:
        return []

    def grad_tensors(self) -> list[torch.Tensor]:
        return []

    def optimizer_tensors(self) -> list[torch.Tensor]:
        return []

    def save(self, folder: str | Path, group=None) -> None:
        raise TypeError("the LoRA reference has no state of its own: the base model folder is its checkpoint")

    def load(self, folder: str | Path, group=None) -> None:
        raise TypeError("the LoRA reference has no state of its own: the base model folder is its checkpoint")
