"""Both parallel layouts: training ``dp_shard x pp x tp`` and generation ``dp x tp``.

Colocated (default) both span the whole world. Separated (``parallel.placement: separated``)
the generation layout spans ranks [0, gen_ranks) and the training layout the rest.

Ranks are laid out TP-innermost, then pipeline stages, from the layout's first rank f. The
``group`` = tp x pp ranks of one model replica hold the same samples: rank r belongs to DP
index (r - f) // group at position (r - f) % group (stage position // tp, TP position % tp),
so a replica never spans nodes when its size divides the ranks per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd_rl.config.errors import Violation
from spmd_rl.config.schema import Config


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    first: int = 0
    """The first global rank of the layout (separated placement: the training side's)."""
    pp: int = 1
    """Pipeline stages (training with actor.backend=megatron only)."""

    @property
    def group(self) -> int:
        """Ranks of one model replica (tp x pp): they hold the same samples."""
        return self.tp * self.pp

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.dp * self.group)

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp index, position in its replica) of a global rank of this layout."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not in this layout (ranks {self.ranks.start}..{self.ranks.stop - 1})")
        return (rank - self.first) // self.group, (rank - self.first) % self.group

    def dp_group_leader(self, dp_index: int) -> int:
        return self.first + dp_index * self.group


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

    @property
    def separated(self) -> bool:
        return self.train.first > 0

    def side_of(self, rank: int) -> str:
        """The side a rank is on: gen or train under separated placement, both colocated."""
        if not self.separated:
            return "both"
        return "gen" if rank in self.gen.ranks else "train"


def world_size(cfg: Config, world: int | None = None) -> int:
    return world if world is not None else cfg.parallel.nnodes * cfg.parallel.nproc_per_node


def _resolve(
    name: str,
    dp: int | None,
    tp: int,
    world: int,
    out: list[Violation],
    first: int = 0,
    what: str = "world size",
    pp: int = 1,
) -> Layout:
    """The layout of ``world`` ranks from ``first`` (``what`` names that rank count in errors)."""
    if world % (tp * pp):
        field, value = (f"parallel.{name}.tp", tp) if pp == 1 else (f"parallel.{name}.pp", pp)
        out.append(
            Violation(
                field,
                value,
                f"{'tp' if pp == 1 else f'tp x pp = {tp * pp}'} does not divide the {what} {world}",
                f"use a divisor of {world}",
            )
        )
        return Layout(dp or 1, tp, first, pp)
    dp_name = "dp_shard" if name == "train" else "dp"
    if dp is None:
        return Layout(world // (tp * pp), tp, first, pp)
    if dp * tp * pp != world:
        prod = f"{dp_name} x tp = {dp} x {tp}" if pp == 1 else f"{dp_name} x pp x tp = {dp} x {pp} x {tp}"
        out.append(
            Violation(
                f"parallel.{name}.{dp_name}",
                dp,
                f"{prod} = {dp * tp * pp} != {what} {world}",
                f"set {dp_name}={world // (tp * pp)} or leave it out to derive it",
            )
        )
    return Layout(dp, tp, first, pp)


def _gen_ranks(cfg: Config, world: int, out: list[Violation]) -> int | None:
    """The generation side's size under separated placement (None when colocated or invalid)."""
    p = cfg.parallel
    if p.placement == "colocated":
        if p.gen_ranks is not None:
            out.append(
                Violation(
                    "parallel.gen_ranks",
                    p.gen_ranks,
                    "only used by parallel.placement: separated",
                    "remove it, or set placement: separated",
                )
            )
        return None
    if p.gen_ranks is None:
        out.append(
            Violation(
                "parallel.gen_ranks",
                None,
                "separated placement needs the size of the generation side",
                f"set it between 1 and {world - 1}",
            )
        )
        return None
    if not 0 < p.gen_ranks < world:
        out.append(
            Violation(
                "parallel.gen_ranks",
                p.gen_ranks,
                f"leaves no rank to {'train' if p.gen_ranks >= world else 'generate'} in a world of {world}",
                f"set it between 1 and {world - 1} (separated placement needs at least 2 ranks)",
            )
        )
        return None
    return p.gen_ranks


def resolve_layouts(
    cfg: Config, world: int | None = None, nproc_per_node: int | None = None
) -> tuple[Layouts, list[Violation]]:
    """Derive the layouts for a world size; violations list every layout that does not fit."""
    w = world_size(cfg, world)
    npn = nproc_per_node or cfg.parallel.nproc_per_node
    out: list[Violation] = []
    if w % npn:
        out.append(
            Violation(
                "parallel.nproc_per_node",
                npn,
                f"does not divide the world size {w}",
                "use ranks per node that divide the world",
            )
        )
    g = _gen_ranks(cfg, w, out)
    if g is None:
        train = _resolve("train", cfg.parallel.train.dp_shard, cfg.parallel.train.tp, w, out, pp=cfg.parallel.train.pp)
        gen = _resolve("gen", cfg.parallel.gen.dp, cfg.parallel.gen.tp, w, out)
    else:
        train = _resolve(
            "train",
            cfg.parallel.train.dp_shard,
            cfg.parallel.train.tp,
            w - g,
            out,
            first=g,
            what="training side's rank count",
            pp=cfg.parallel.train.pp,
        )
        gen = _resolve("gen", cfg.parallel.gen.dp, cfg.parallel.gen.tp, g, out, what="parallel.gen_ranks")
    return Layouts(w, npn, train, gen), out
