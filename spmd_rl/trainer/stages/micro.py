"""Micro-batches of a mini-batch: at most ``micro_batch_size`` samples each, and, with
``actor.micro_batch_tokens`` set, at most that many tokens (verl's dynamic batch size).

The rows are a mini-batch's share on this rank, longest first (``minibatch.length_order``).
A micro-batch is a run of consecutive rows, so its samples have similar lengths. Its cost is
what the forward computes: the sum of the samples' lengths when sequences are packed
(``actor.pack_sequences``), else count x longest (right padding to the first row's length).

Invariants (tested):

- the runs cover the rows in order, each row once;
- a run holds at most ``micro_batch_size`` samples, and costs at most the budget unless it is a
  single sample (the config rules refuse a budget below one full-length sample);
- every rank of the training side runs the same number of micro-batches per mini-batch: FSDP's
  all-gathers and reduce-scatters are collectives, so a rank with fewer would leave the others
  waiting. The counts are all-reduced (MAX, one collective per stage) and a rank below the
  maximum halves its costliest run until it matches;
- the objective does not depend on the split: every micro-batch loss is normalised by the whole
  mini-batch's counts (``minibatch.mini_batch_norm``), so the gradient is that of fixed-size
  micro-batches up to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd_rl.config.schema import Config
from spmd_rl.trainer.metrics import global_maxes


def run_cost(lengths: Sequence[int], packed: bool) -> int:
    """Tokens a forward over these samples computes: their sum packed, count x longest padded."""
    return sum(lengths) if packed else len(lengths) * max(lengths, default=0)


def token_runs(lengths: Sequence[int], max_samples: int, budget: int | None, packed: bool) -> list[slice]:
    """Greedy runs of consecutive rows (the fewest for this order): a row joins the current run
    while the run stays within ``max_samples`` samples and ``budget`` tokens."""
    runs, start, total, longest = [], 0, 0, 0
    for k, n in enumerate(lengths):
        total, longest = total + n, max(longest, n)
        count = k - start + 1
        cost = total if packed else count * longest
        if count > 1 and (count > max_samples or (budget is not None and cost > budget)):
            runs.append(slice(start, k))
            start, total, longest = k, n, n
    if lengths:
        runs.append(slice(start, len(lengths)))
    return runs


def split_to(runs: list[slice], lengths: Sequence[int], count: int, packed: bool) -> list[slice]:
    """Halve the costliest run of two or more samples until there are ``count`` runs."""
    runs = list(runs)
    while len(runs) < count:
        splittable = [k for k, r in enumerate(runs) if r.stop - r.start > 1]
        if not splittable:
            raise ValueError(f"{len(lengths)} samples cannot make {count} micro-batches")
        k = max(splittable, key=lambda j: run_cost(lengths[runs[j]], packed))
        r = runs[k]
        mid = r.start + (r.stop - r.start + 1) // 2
        runs[k : k + 1] = [slice(r.start, mid), slice(mid, r.stop)]
    return runs


def micro_plan(
    cfg: Config, lengths: torch.Tensor, minis: Sequence[slice], max_samples: int, group=None
) -> list[list[slice]]:
    """Each mini-batch's micro-batches as row slices of this rank's ordered rows. Collective over
    the training side (``group``, ``Run.sides.group``) when ``actor.micro_batch_tokens`` is set
    (every rank calls it with the same number of mini-batches)."""
    budget, packed = cfg.actor.micro_batch_tokens, cfg.actor.pack_sequences
    rows = [lengths[sl].tolist() for sl in minis]
    runs = [token_runs(r, max_samples, budget, packed) for r in rows]
    if budget is not None and runs:
        most = global_maxes({f"mini{j:05d}": len(r) for j, r in enumerate(runs)}, group)
        runs = [split_to(r, rows[j], int(most[f"mini{j:05d}"]), packed) for j, r in enumerate(runs)]
    return [[slice(sl.start + r.start, sl.start + r.stop) for r in mini] for sl, mini in zip(minis, runs)]
