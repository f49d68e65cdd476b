"""The parameter inventory of a decoder-only HF model, read from its ``config.json`` alone.

Used by validation (head counts, max positions) and by the memory/resharding estimates: every
tensor is listed with its element count and whether tensor parallelism splits it. Embedding
and LM head are vocab-parallel (split); attention and MLP projections are column/row parallel
(split, biases follow their weight); norms are replicated. In a Qwen3-MoE sparse layer (layer i
with (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers) the MLP is a router
``mlp.gate`` [E, H] (replicated) and E experts of ``moe_intermediate_size``, listed one expert
at a time as checkpoints name them (``expert``: what expert parallelism divides).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe")


@dataclass(frozen=True)
class Tensor:
    name: str
    numel: int
    tp_split: bool
    """Split by tensor parallelism in the generation engine (vLLM: vocab-parallel embedding too)."""
    train_tp_split: bool = True
    """Split by the training engine's TP plan (engines/fsdp/parallelize.py replicates embeddings)."""
    expert: bool = False
    """One expert's weight of an MoE layer: expert parallelism places it on one rank of E."""


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    """Routed experts per sparse layer (0: a dense model)."""
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True
    """The top-k gate weights are renormalised to sum to 1 (Qwen3-MoE's default)."""
    rope_type: str = "default"
    """The rotary embedding's scaling (``rope_parameters`` / ``rope_scaling``): ``llama3``, ``yarn``, ..."""

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelArch":
        model_type = cfg.get("model_type", "?")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_positions=int(cfg.get("max_position_embeddings", 0)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope_type=str((cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).get("rope_type") or "default"),
            **(cls._moe(cfg) if model_type == "qwen3_moe" else {}),
        )

    @staticmethod
    def _moe(cfg: dict) -> dict:
        layers, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 5 writes the second
        if experts is None:
            raise KeyError("num_experts")
        return {
            "num_experts": int(experts),
            "experts_per_token": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
            "sparse_layers": tuple(i for i in range(layers) if (i + 1) % step == 0 and i not in dense),
        }

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelArch":
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))

    def tensors(self) -> list[Tensor]:
        """Every parameter tensor with HF names (layer tensors listed per layer)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        out = [Tensor("model.embed_tokens.weight", self.vocab_size * h, True, train_tp_split=False)]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out += [
                Tensor(p + "input_layernorm.weight", h, False, False),
                Tensor(p + "self_attn.q_proj.weight", q * h, True),
                Tensor(p + "self_attn.k_proj.weight", kv * h, True),
                Tensor(p + "self_attn.v_proj.weight", kv * h, True),
                Tensor(p + "self_attn.o_proj.weight", h * q, True),
                Tensor(p + "post_attention_layernorm.weight", h, False, False),
            ]
            out += self._mlp(p, i)
            if self.qkv_bias:
                out += [Tensor(p + f"self_attn.{n}_proj.bias", s, True) for n, s in (("q", q), ("k", kv), ("v", kv))]
            if self.qk_norm:
                out += [
                    Tensor(p + "self_attn.q_norm.weight", d, False, False),
                    Tensor(p + "self_attn.k_norm.weight", d, False, False),
                ]
        out.append(Tensor("model.norm.weight", h, False, False))
        if not self.tie_word_embeddings:
            out.append(Tensor("lm_head.weight", self.vocab_size * h, True, train_tp_split=False))
        return out

    def _mlp(self, p: str, layer: int) -> list[Tensor]:
        h = self.hidden_size
        if layer not in self.sparse_layers:
            f = self.intermediate_size
            return [Tensor(p + f"mlp.{n}_proj.weight", f * h, True) for n in ("gate", "up", "down")]
        f, out = self.moe_intermediate_size, [Tensor(p + "mlp.gate.weight", self.num_experts * h, False, False)]
        for e in range(self.num_experts):
            out += [
                Tensor(p + f"mlp.experts.{e}.{n}_proj.weight", f * h, True, expert=True) for n in ("gate", "up", "down")
            ]
        return out

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def expert_numel(self) -> int:
        """Elements of every expert weight (the paper's EW, in elements)."""
        return sum(t.numel for t in self.tensors() if t.expert)

    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors())

    def split_numel(self) -> int:
        """Elements of tensors that TP splits, experts excepted (the paper's TW, in elements)."""
        return sum(t.numel for t in self.tensors() if t.tp_split and not t.expert)

    def largest_tensor_numel(self) -> int:
        return max(t.numel for t in self.tensors())
