"""Both parallel layouts over one world: training ``dp_shard x tp`` and generation ``dp x tp``.

Ranks are laid out TP-innermost: in a layout with TP degree t, rank r belongs to TP group
r // t (its DP index) at TP position r % t, so a TP group never spans nodes when t divides
the ranks per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd_rl.config.errors import Violation
from spmd_rl.config.schema import Config


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp index, tp index) of a global rank."""
        return rank // self.tp, rank % self.tp

    def dp_group_leader(self, dp_index: int) -> int:
        return dp_index * self.tp


@dataclass(frozen=True)
class Layouts:
    world: int
    nproc_per_node: int
    train: Layout
    gen: Layout

    @property
    def nnodes(self) -> int:
        return self.world // self.nproc_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.nproc_per_node


def world_size(cfg: Config, world: int | None = None) -> int:
    return world if world is not None else cfg.parallel.nnodes * cfg.parallel.nproc_per_node


def _resolve(name: str, dp: int | None, tp: int, world: int, out: list[Violation]) -> Layout:
    if world % tp:
        out.append(Violation(f"parallel.{name}.tp", tp, f"does not divide the world size {world}", f"use a divisor of {world}"))
        return Layout(dp or 1, tp)
    dp_name = "dp_shard" if name == "train" else "dp"
    if dp is None:
        return Layout(world // tp, tp)
    if dp * tp != world:
        out.append(
            Violation(
                f"parallel.{name}.{dp_name}", dp, f"{dp_name} x tp = {dp} x {tp} = {dp * tp} != world size {world}",
                f"set {dp_name}={world // tp} or leave it out to derive it",
            )
        )
    return Layout(dp, tp)


def resolve_layouts(cfg: Config, world: int | None = None, nproc_per_node: int | None = None) -> tuple[Layouts, list[Violation]]:
    """Derive the layouts for a world size; violations list every layout that does not fit."""
    w = world_size(cfg, world)
    npn = nproc_per_node or cfg.parallel.nproc_per_node
    out: list[Violation] = []
    if w % npn:
        out.append(Violation("parallel.nproc_per_node", npn, f"does not divide the world size {w}", "use ranks per node that divide the world"))
    train = _resolve("train", cfg.parallel.train.dp_shard, cfg.parallel.train.tp, w, out)
    gen = _resolve("gen", cfg.parallel.gen.dp, cfg.parallel.gen.tp, w, out)
    return Layouts(w, npn, train, gen), out
