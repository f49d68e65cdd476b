"""What the update read, gathered for the prompt ledger (``trainer.ledger``).

The ledger's ``trained`` is not what the sampler handed out but what ``actor_update`` read from
the dock: every writer reports (sample index, ``prompt_row``) of each sample of its share
(``StageResult.consumed``), and one collective sums, per sample index of the iteration, the
row + 1 and a count. A sample read twice has count 2; a group whose samples name different rows
appears once per row; so a desync between the generators' and the trainers' samplers, or an
index mix-up between a putter and the update, shows in ``ledger.problems``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def trained_groups(consumed: list[tuple[int, int]], size: int, n: int, group=None) -> tuple[list[int], int]:
    """Collective over ``group``, this side's ranks (``Run.sides.group``), with every rank's
    ``consumed`` pairs (empty on non-writers) and the iteration's number of sample indices ``size``: (the row of each
    (prompt group q = index // n, row) pair read, in group order; the number of samples read,
    repeats included)."""
    buf = torch.zeros(2, size, dtype=torch.int64)  # row + 1 summed, reads
    for index, row in consumed:
        buf[0, index] += row + 1
        buf[1, index] += 1
    dist.all_reduce(buf, group=group)
    read = buf[1].nonzero().flatten().tolist()
    pairs = sorted({(i // n, int(buf[0, i]) // int(buf[1, i]) - 1) for i in read})
    return [row for _, row in pairs], int(buf[1].sum())
