"""Device meshes of both layouts over the same world (TP innermost, as in config.layout)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from spmd_rl.config.layout import Layouts
from spmd_rl.distributed.accelerator import Accelerator


@dataclass
class Meshes:
    train: DeviceMesh  # dims ("dp_shard", "tp")
    gen: DeviceMesh  # dims ("dp", "tp")


def build_meshes(acc: Accelerator, layouts: Layouts) -> Meshes:
    dev = acc.device.type
    train = init_device_mesh(dev, (layouts.train.dp, layouts.train.tp), mesh_dim_names=("dp_shard", "tp"))
    gen = init_device_mesh(dev, (layouts.gen.dp, layouts.gen.tp), mesh_dim_names=("dp", "tp"))
    return Meshes(train, gen)
