"""Pipeline stages and expert-parallel ranks of the megatron backend: which parameters each
rank holds, and the names between a rank's own mcore parameters and the global ones that
``hf_map`` maps. Expert-parallel rank r of ep holds experts [r E/ep, (r+1) E/ep) of every sparse
layer, numbered from 0 locally.

Stage k of ``pp`` holds decoder layers [k L/pp, (k+1) L/pp) (mcore's uniform split; its local
indices start at 0), the embedding on stage 0, and the final norm and the output layer on stage
pp - 1. With tied embeddings and pp > 1 the last stage holds a copy of the embedding as its
output layer (mcore keeps the two equal by summing their gradients over its embedding group):
the copy is loaded from, and checkpointed as, the embedding (:data:`TIED_COPY` ->
:data:`TIED_TWIN`), and exported once, by stage 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmd_rl.engines.training.hf_weights import SafetensorsFolder
from spmd_rl.engines.megatron.hf_map import Shape, mcore_names, to_mcore

TIED_COPY = "output_layer.weight"
TIED_TWIN = "embedding.word_embeddings.weight"


def stage_of(name: str, layers: int, pp: int) -> int:
    """The stage that holds global mcore parameter ``name``."""
    if name.startswith("embedding."):
        return 0
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2]) // (layers // pp)
    return pp - 1


def expert_of(name: str) -> int | None:
    """The global expert index of an expert parameter's global name (None for the rest)."""
    parts = name.split(".")
    return int(parts[6]) if len(parts) > 6 and parts[4:6] == ["experts", "local_experts"] else None


def to_global(local: str, layers: int, pp: int, stage: int, tied: bool, per_ep_rank: int = 0, ep_rank: int = 0) -> str:
    """The global mcore name of stage ``stage``'s parameter ``local`` (the tied copy's twin for
    the last stage's output layer of a tied model; experts renumbered from this EP rank's first,
    ``per_ep_rank`` experts each)."""
    if local.startswith("decoder.layers."):
        parts = local.split(".")
        parts[2] = str(int(parts[2]) + stage * (layers // pp))
        if parts[4:6] == ["experts", "local_experts"]:
            parts[6] = str(int(parts[6]) + ep_rank * per_ep_rank)
        return ".".join(parts)
    if tied and local == TIED_COPY:
        return TIED_TWIN
    return local


class StageWeights:
    """What crosses the pipeline and expert-parallel groups: every rank's full parameters for
    the rollout engine (``share``, from the rank that holds each), and the last stage's
    per-micro-batch outputs for the stages that compute none (``from_last``)."""

    def __init__(self, path, shape: Shape, config, pp: int, device: torch.device, ep: int = 1):
        self.shape, self.pp, self.device, self.ep = shape, pp, device, ep
        self.names = mcore_names(shape, config.add_qkv_bias, config.qk_layernorm)
        """Every exported global mcore name (no tied copy), in the model's order."""
        self._hf = {n: meta[2] for n, meta in SafetensorsFolder(path).index.items()}

    def meta(self, name: str) -> torch.Tensor:
        """The full mcore tensor ``name`` on the meta device (shapes from the HF folder's headers)."""
        return to_mcore(name, lambda n: torch.empty(self._hf[n], device="meta"), self.shape)

    def _group(self):
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_group()

    def share(self, name: str, full: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The full tensor ``name`` on every rank: ``full`` is given on the rank that holds it
        (None elsewhere). An expert goes first over the expert-parallel group of its stage, then
        everything over the pipeline group."""
        from megatron.core import parallel_state as ps

        stage = stage_of(name, self.shape.layers, self.pp)
        expert = expert_of(name)
        if full is None and (self.pp > 1 or (self.ep > 1 and expert is not None)):
            full = torch.empty(self.meta(name).shape, dtype=dtype, device=self.device)
        if self.ep > 1 and expert is not None and stage == ps.get_pipeline_model_parallel_rank():
            group = ps.get_expert_model_parallel_group()
            dist.broadcast(full, dist.get_global_rank(group, expert // (self.shape.experts // self.ep)), group=group)
        if self.pp > 1:
            group = self._group()
            dist.broadcast(full, dist.get_global_rank(group, stage), group=group)
        return full

    def from_last(self, outs: list[tuple], sizes: list[tuple[int, int]], with_entropy: bool) -> list[tuple]:
        """Each micro-batch's ([b, w] log-probs, entropies or None) on every stage: ``outs`` holds
        them on the last stage, ``sizes`` their (b, w) everywhere."""
        if self.pp == 1:
            return outs
        group, last = self._group(), self.pp - 1
        src = dist.get_global_rank(group, last)
        mine = dist.get_group_rank(group, dist.get_rank()) == last

        def bcast(t: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
            t = t.float().to(self.device) if mine else torch.empty(shape, dtype=torch.float32, device=self.device)
            dist.broadcast(t, src, group=group)
            return t

        return [(bcast(lp, size), bcast(ent, size) if with_entropy else None) for (lp, ent), size in zip(outs, sizes)]
