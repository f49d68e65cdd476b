"""Hugging Face <-> megatron-core names, layouts and tensor-parallel slices for the decoders
(Qwen2, Qwen3, Llama, Qwen3-MoE) built from mcore's local layer spec.

Per decoder layer i (H hidden, nh query heads, ng KV groups, hd head dim, F intermediate):

| HF                                             | mcore                                                   |
|------------------------------------------------|---------------------------------------------------------|
| model.embed_tokens.weight                      | embedding.word_embeddings.weight (vocab-parallel, dim 0) |
| model.layers.i.input_layernorm.weight          | decoder.layers.i.input_layernorm.weight                 |
| self_attn.{q,k,v}_proj.{weight,bias}           | self_attention.linear_qkv.{weight,bias} (column, dim 0)  |
| self_attn.{q,k}_norm.weight (Qwen3)            | self_attention.{q,k}_layernorm.weight                   |
| self_attn.o_proj.weight                        | self_attention.linear_proj.weight (row, dim 1)          |
| post_attention_layernorm.weight                | decoder.layers.i.pre_mlp_layernorm.weight               |
| mlp.{gate,up}_proj.weight                      | mlp.linear_fc1.weight = [gate; up] (column, dim 0)       |
| mlp.down_proj.weight                           | mlp.linear_fc2.weight (row, dim 1)                      |
| model.norm.weight                              | decoder.final_layernorm.weight                          |
| lm_head.weight (untied only)                   | output_layer.weight (column, dim 0)                     |

In a Qwen3-MoE sparse layer the MLP rows are instead:

| HF                                             | mcore                                                   |
|------------------------------------------------|---------------------------------------------------------|
| mlp.gate.weight (router)                       | mlp.router.weight (replicated)                          |
| mlp.experts.e.{gate,up}_proj.weight            | mlp.experts.local_experts.e.linear_fc1.weight = [gate; up] |
| mlp.experts.e.down_proj.weight                 | mlp.experts.local_experts.e.linear_fc2.weight           |

with e the *global* expert index here; an expert-parallel rank numbers its own experts from 0
(``pipeline.to_global`` maps them).

QKV layout: for each KV group g, the rows [q heads of g (nh/ng x hd); k_g (hd); v_g (hd)],
stacked over g (``attention.py`` views its output as [s, b, ng, (nh/ng + 2) hd]). A contiguous
TP chunk of dim 0 is therefore ng/tp whole groups (``validate`` requires tp | ng). ``linear_fc1``
on TP rank r holds [gate_r; up_r], the r-th chunks of each, not a chunk of the concatenation.

Invariant (tested): ``to_hf(name, gather(slice(to_mcore(w))))`` returns the HF tensors bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from spmd_rl.config.model_arch import ModelArch

COLUMN = (
    "embedding.word_embeddings.weight",
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
    "output_layer.weight",
)
ROW = ("linear_proj.weight", "linear_fc2.weight")


@dataclass(frozen=True)
class Shape:
    """The attention geometry of an HF config."""

    layers: int
    nh: int
    ng: int
    hd: int
    tied: bool
    experts: int = 0
    """Routed experts per sparse layer (0: dense)."""
    sparse: tuple[int, ...] = ()
    """The layers whose MLP is a mixture of experts."""

    @classmethod
    def of(cls, hf_config) -> "Shape":
        nh = hf_config.num_attention_heads
        hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // nh
        arch = ModelArch.from_dict(
            hf_config.to_dict()
        )  # the experts and sparse layers, read as plan and validate read them
        return cls(
            hf_config.num_hidden_layers,
            nh,
            hf_config.num_key_value_heads,
            hd,
            bool(hf_config.tie_word_embeddings),
            arch.num_experts,
            arch.sparse_layers,
        )


def qkv_interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Shape) -> torch.Tensor:
    """HF q [nh hd, *r], k and v [ng hd, *r] -> mcore's per-group layout [(nh + 2 ng) hd, *r]."""
    r = q.shape[1:]
    return torch.cat(
        [q.reshape(s.ng, s.nh // s.ng * s.hd, *r), k.reshape(s.ng, s.hd, *r), v.reshape(s.ng, s.hd, *r)], 1
    ).reshape(-1, *r)


def qkv_split(w: torch.Tensor, s: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`qkv_interleave`."""
    r = w.shape[1:]
    q, k, v = torch.split(w.reshape(s.ng, (s.nh // s.ng + 2) * s.hd, *r), [s.nh // s.ng * s.hd, s.hd, s.hd], 1)
    return q.reshape(-1, *r), k.reshape(-1, *r), v.reshape(-1, *r)


def mcore_names(s: Shape, has_qkv_bias: bool, qk_norm: bool) -> list[str]:
    """Every mcore parameter name, in the model's own order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(s.layers):
        m = f"decoder.layers.{i}."
        names += [
            m + "input_layernorm.weight",
            m + "self_attention.linear_proj.weight",
            m + "self_attention.linear_qkv.weight",
        ]
        names += [m + "self_attention.linear_qkv.bias"] if has_qkv_bias else []
        names += [m + "self_attention.q_layernorm.weight", m + "self_attention.k_layernorm.weight"] if qk_norm else []
        names.append(m + "pre_mlp_layernorm.weight")
        if i in s.sparse:
            names.append(m + "mlp.router.weight")
            names += [f"{m}mlp.experts.local_experts.{e}.linear_fc{k}.weight" for e in range(s.experts) for k in (1, 2)]
        else:
            names += [m + "mlp.linear_fc1.weight", m + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    return names + ([] if s.tied else ["output_layer.weight"])


def _layer(name: str) -> tuple[str, str]:
    """'decoder.layers.3.mlp.linear_fc1.weight' -> ('model.layers.3.', 'mlp.linear_fc1.weight')."""
    parts = name.split(".")
    return f"model.layers.{parts[2]}.", ".".join(parts[3:])


_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def to_mcore(name: str, read: Callable[[str], torch.Tensor], s: Shape) -> torch.Tensor:
    """The full mcore tensor ``name``, built from HF tensors that ``read(hf_name)`` returns."""
    return from_hf_parts(name, [read(n) for n in hf_names(name)], s)


def to_hf(name: str, full: torch.Tensor, s: Shape) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of one mcore tensor (full, or TP-local with ``s`` the local
    shape): the inverse of :func:`from_hf_parts`."""
    if name.endswith("linear_fc1.weight"):
        parts = full.chunk(2)
    elif ".linear_qkv." in name:
        parts = qkv_split(full, s)
    else:
        parts = (full,)
    return zip(hf_names(name), parts)


def hf_names(name: str) -> list[str]:
    """The HF names of mcore parameter ``name``, in :func:`to_hf`'s order."""
    if name in _TOP:
        return [_TOP[name]]
    pre, rest = _layer(name)
    if rest in _SIMPLE:
        return [pre + _SIMPLE[rest]]
    if rest.startswith("self_attention.linear_qkv."):
        return [f"{pre}self_attn.{p}_proj.{rest.rsplit('.', 1)[1]}" for p in "qkv"]
    if rest == "mlp.linear_fc1.weight":
        return [pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"]
    if rest == "mlp.router.weight":
        return [pre + "mlp.gate.weight"]
    if rest.startswith("mlp.experts.local_experts."):
        e, fc = rest.split(".")[3], rest.split(".")[4]
        parts = ("gate_proj", "up_proj") if fc == "linear_fc1" else ("down_proj",)
        return [f"{pre}mlp.experts.{e}.{p}.weight" for p in parts]
    raise KeyError(f"no HF name for mcore parameter {name!r}")


def from_hf_parts(name: str, parts: list[torch.Tensor], s: Shape) -> torch.Tensor:
    """The mcore tensor from its HF tensors in :func:`hf_names` order (full, or TP-local with
    ``s`` the local shape): the inverse of :func:`to_hf`."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if name.endswith("linear_fc1.weight") else qkv_interleave(*parts, s)


def tp_dim(name: str) -> int | None:
    """The dimension TP splits (0 column / vocab-parallel, 1 row), None when replicated."""
    if name.endswith(COLUMN):
        return 0
    return 1 if name.endswith(ROW) else None


def tp_slice(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s part of a full mcore tensor (module docstring: fc1 is [gate_r; up_r])."""
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return full.chunk(tp, dim)[rank]


def tp_join(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full mcore tensor from every TP rank's part, in rank order (inverse of :func:`tp_slice`)."""
    dim = tp_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(parts, dim)
