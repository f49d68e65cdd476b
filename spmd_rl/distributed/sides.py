"""The process groups of a placement, and the group this rank's collectives run on.

Colocated, every rank runs every stage and a stage's collectives (metric sums, token-mean
normalisers, checkpoint barriers) span the world. Separated (``parallel.placement:
separated``), the generation side [0, gen_ranks) and the training side run different
iterations at the same time, so each side's collectives must span only that side:
``Sides.group`` is the group every such collective passes (None = the world), and
``Sides.leader`` the rank that writes a side's files and metadata (rank 0 colocated). The
weights travel on the sync group: the training leader plus every generator.

``torch.distributed.new_group`` is collective over the world, so ``init_sides`` runs on every
rank with the same layouts, before anything else creates groups. The run holds the result
(``trainer.context.Run.sides``); nothing here is a module global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from spmd_rl.config.layout import Layouts


@dataclass
class Sides:
    side: str
    """This rank's side: "gen", "train" or "both" (colocated)."""
    group: object | None = None
    """This side's process group; None = the world."""
    leader: int = 0
    sync_group: object | None = None
    """Separated: the training leader + every generator (the weight broadcast)."""
    train_leader: int = 0


def init_sides(lay: Layouts, rank: int) -> Sides:
    """Create the groups of ``lay``'s placement on every rank (collective); returns this rank's."""
    if not lay.separated:
        return Sides("both")
    gen, train = list(lay.gen.ranks), list(lay.train.ranks)
    groups = {"gen": dist.new_group(gen), "train": dist.new_group(train)}
    sync = dist.new_group([train[0], *gen])
    side = lay.side_of(rank)
    return Sides(side, groups[side], (gen if side == "gen" else train)[0], sync, train[0])
