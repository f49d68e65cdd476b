"""The training engines' device mesh (TP innermost, as in config.layout).

Colocated it spans the world; separated (``parallel.placement: separated``) only the training
side's ranks. ``DeviceMesh`` creates its dimension groups collectively, so every rank builds
it, including generators that hold no training engine. The rollout engine needs no mesh: vLLM
forms its own groups."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spmd_rl.config.layout import Layout
from spmd_rl.distributed.accelerator import Accelerator


def train_mesh(acc: Accelerator, train: Layout) -> DeviceMesh | None:
    """None with pipeline stages: megatron forms its own groups there, and the FSDP engines
    refuse pp > 1 (``recipe.backend_rules``)."""
    if train.pp > 1:
        return None
    ranks = torch.arange(train.first, train.first + train.dp * train.tp).view(train.dp, train.tp)
    return DeviceMesh(acc.device.type, ranks, mesh_dim_names=("dp_shard", "tp"))


def replica_group(layout: Layout, rank: int):
    """The process group of this rank's replica in ``layout`` (its TP ranks), or None when the
    rank is not in the layout. ``new_group`` is collective over the world: every rank calls this,
    and every replica's group is created in the same order."""
    groups = [
        dist.new_group(list(range(layout.dp_group_leader(g), layout.dp_group_leader(g) + layout.group)))
        for g in range(layout.dp)
    ]
    return groups[layout.coords(rank)[0]] if rank in layout.ranks else None
