"""An MoE layer's experts between the layout transformers keeps in memory and the layout
checkpoints, vLLM and ``export`` name: transformers 5 fuses them per layer (its
``conversion_mapping`` for qwen2_moe / qwen3_moe: ``MergeModulelist(dim=0)``, then
``Concatenate(dim=1)`` of gate and up), checkpoints list them one expert at a time:

    <p>.mlp.experts.gate_up_proj [E, 2I, H] = stack_e(cat(<p>.mlp.experts.e.gate_proj.weight [I, H],
                                                           <p>.mlp.experts.e.up_proj.weight [I, H]))
    <p>.mlp.experts.down_proj    [E, H, I]  = stack_e(<p>.mlp.experts.e.down_proj.weight [H, I])

Invariant (tested): ``split(name, read(folder, name, E))`` returns the folder's tensors bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

_FUSED = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def is_fused(name: str) -> bool:
    return _FUSED.match(name) is not None


def checkpoint_names(name: str, num_experts: int) -> list[str]:
    """The per-expert names of fused parameter ``name``, in the order ``read`` stacks them
    (``[name]`` for any other parameter)."""
    m = _FUSED.match(name)
    if m is None:
        return [name]
    parts = ("gate_proj", "up_proj") if m["kind"] == "gate_up_proj" else ("down_proj",)
    return [f"{m['pre']}.{e}.{p}.weight" for e in range(num_experts) for p in parts]


def read(reader: Callable[[str], torch.Tensor], name: str, num_experts: int) -> torch.Tensor:
    """The in-memory tensor ``name`` from per-expert checkpoint tensors (``reader(hf_name)``)."""
    if not is_fused(name):
        return reader(name)
    names = checkpoint_names(name, num_experts)
    per = len(names) // num_experts
    return torch.stack([torch.cat([reader(n) for n in names[e * per : (e + 1) * per]]) for e in range(num_experts)])


def split(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs of in-memory tensor ``name`` (the inverse of ``read``)."""
    if not is_fused(name):
        yield name, tensor
        return
    names = checkpoint_names(name, tensor.shape[0])
    per = len(names) // tensor.shape[0]
    for e in range(tensor.shape[0]):
        for k, piece in enumerate(tensor[e].chunk(per)):
            yield names[e * per + k], piece


def split_shape(name: str, shape: list[int]) -> list[tuple[str, list[int]]]:
    """``split``'s names and shapes from a shape alone."""
    return [(n, list(t.shape)) for n, t in split(name, torch.empty(shape, device="meta"))]
