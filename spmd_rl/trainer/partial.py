"""Partial rollout (``stream.partial_tokens`` = B; the MindSpeed RL paper's Table 2, Kimi
k1.5's partial rollouts): long responses are generated across iterations instead of holding
every iteration up. One round per iteration:

1. The data loader puts the iteration's G prompt groups. Generation DP group g fills its G/dp
   slots first with the groups it carries from the previous iteration (oldest first), then with
   new prompts from the sampler; the ``prefix_*`` columns hold each sample's response so far.
2. The rollout continues every unfinished sample by at most B tokens (``stages.rollout``).
3. Every rank learns which groups finished (one all-reduce of a [G] count). The finished
   groups, the lowest slots first and rounded down to a multiple of the training DP size (every
   DP rank then trains the same number of groups), are rewarded and trained now. Every other
   group is carried by the generation DP group that generated it, and continued after the
   weight update with its tokens, behaviour log-probs and versions.

Invariants (tested): no prompt group is lost or trained twice; over a run, new groups =
trained groups + groups still carried (the ``partial_*`` metrics). A checkpoint records the
carried prompts' rows; a resumed run starts them again from their prompts (partial responses
are not saved). Every trained token has the version that generated it; the lag (iteration -
version) is logged as ``policy_lag_mean`` / ``policy_lag_max``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmd_rl.recipe.graph import partial_columns
from spmd_rl.trainer.carry import CarriedGroup
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.iteration_metrics import IterationMetrics
from spmd_rl.trainer.ledger import StepRecord
from spmd_rl.trainer.metrics import StageTimer
from spmd_rl.trainer.runner import is_writer, run_stage
from spmd_rl.trainer.stages.samples import prompt_columns


def put_partial_prompts(run: Run, it: int) -> tuple[list[int], list[int]]:
    """Step 1; returns (the new rows drawn from the sampler, every slot's row)."""
    lay, G, n = run.lay.gen, run.cfg.data.global_batch_size, run.cfg.rollout.n
    g, tp_rank = lay.coords(run.peer.rank)
    per = G // lay.dp
    reused = min(len(run.progress.carry), per)
    counts = torch.zeros(lay.dp, dtype=torch.int64)
    if tp_rank == 0:
        counts[g] = reused
    dist.all_reduce(counts)
    fresh = [per - int(c) for c in counts]
    rows = run.sampler.next_batch(sum(fresh))
    start = sum(fresh[:g])
    mine = run.progress.carry[:reused] + [CarriedGroup.fresh(r, n) for r in rows[start : start + fresh[g]]]
    del run.progress.carry[:reused]
    slot_rows = torch.zeros(G, dtype=torch.int64)  # row + 1 of every slot, filled by its putter
    if tp_rank == 0:
        slot_rows[g * per : (g + 1) * per] = torch.tensor([grp.row + 1 for grp in mine])
    dist.all_reduce(slot_rows)
    if tp_rank == 0:
        pieces = [p for grp in mine for p in grp.pieces]
        prefix = [p.columns() for p in pieces]
        cols = prompt_columns(run, [p.row for p in pieces]) | {
            "prefix_done": torch.stack([c["prefix_done"] for c in prefix])
        }
        names = tuple(c for c in partial_columns(run.cfg) if c not in ("prefix_done", "prefix_env_reward"))
        cols |= {k: [c.get(k, torch.zeros(0, dtype=torch.uint8)) for c in prefix] for k in names}
        if "prefix_env_reward" in partial_columns(run.cfg):
            cols["prefix_env_reward"] = torch.stack([c.get("prefix_env_reward", torch.tensor(0.0)) for c in prefix])
        run.dock.put("data", it, cols, list(range(g * per * n, (g + 1) * per * n)))
    return rows, [int(r) - 1 for r in slot_rows]


def partial_round(run: Run, it: int, timer: StageTimer, m: IterationMetrics) -> tuple[list[int], StepRecord]:
    """Steps 1-3 and the per-round stages on the trained groups; returns their sample indices
    and the iteration's prompt accounting."""
    G, N = run.cfg.data.global_batch_size, run.cfg.rollout.n
    with timer.stage("prompts"):
        new, slot_rows = put_partial_prompts(run, it)
    rollout = run.graph[0]
    res = run_stage(run, it, rollout, list(range(G * N)), timer)
    m.add(res)
    finished = torch.zeros(G, dtype=torch.int64)
    if is_writer(run, rollout):
        for i, p in res.pieces.items():
            finished[i // N] += int(p.done)
    dist.all_reduce(finished)
    complete = [q for q in range(G) if int(finished[q]) == N]
    keep = set(complete[: len(complete) // run.lay.train.dp * run.lay.train.dp])
    groups: dict[int, list] = {}
    for i, p in sorted(res.pieces.items()):
        groups.setdefault(i // N, []).append(p)
    run.progress.carry += [CarriedGroup(ps[0].row, ps) for q, ps in sorted(groups.items()) if q not in keep]
    train_idx = [q * N + k for q in sorted(keep) for k in range(N)]
    if train_idx:
        for stage in run.graph[1:]:
            if stage.per_round:
                m.add(run_stage(run, it, stage, train_idx, timer))
    carried = carried_rows(run)
    m.final |= {
        "partial_new_groups": float(len(new)),
        "partial_trained_groups": float(len(keep)),
        "partial_carried_groups": float(len(carried)),
    }
    return train_idx, StepRecord(it, new, [], carried, put=[r for r in slot_rows if r >= 0])  # trained: run_iteration


def carried_rows(run: Run) -> list[int]:
    """Collective: the dataset rows of every carried group, generation DP group by group."""
    lay = run.lay.gen
    g, tp_rank = lay.coords(run.peer.rank)
    size = torch.tensor([len(run.progress.carry)], dtype=torch.int64)
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    buf = torch.zeros(lay.dp, int(size), dtype=torch.int64)  # row + 1; 0 = empty
    if tp_rank == 0 and run.progress.carry:
        buf[g, : len(run.progress.carry)] = torch.tensor([c.row + 1 for c in run.progress.carry])
    dist.all_reduce(buf)
    return [int(r) - 1 for r in buf.flatten() if r > 0]


def restore_carry(run: Run, rows: list[int]) -> None:
    """A resumed run's carry: the checkpoint's carried rows dealt over the generation DP groups,
    each started again from its prompt."""
    g = run.lay.gen.coords(run.peer.rank)[0]
    run.progress.carry = [CarriedGroup.fresh(r, run.cfg.rollout.n) for r in rows[g :: run.lay.gen.dp]]
