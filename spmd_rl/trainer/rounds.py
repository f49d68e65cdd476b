"""How an iteration's prompt groups are generated and rewarded before the update: one strategy
per run, chosen once from its modes (``rounds_for``), each a function of (run, iteration, timer,
metrics) returning the sample indices the later stages train on and the iteration's prompt
accounting:

- ``one_round``: G prompt groups (``data.global_batch_size``), generated and rewarded once;
- ``dynamic_sampling`` (DAPO): rounds of G groups until G of them carry signal
  (``algos.dynamic_sampling``), at most ``1 + algorithm.max_extra_rounds``, topped up with
  constant groups when short;
- ``trainer.partial.partial_round`` (``stream.partial_tokens``): the groups that finished.

Round r's prompt p is group r * G + p, its samples (r * G + p) * N + k. A strategy reads G and N
from the run it is given (under elastic replicas, the replica's share), never from its choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist

from spmd_rl.algos.dynamic_sampling import GroupSelection
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.fusion import run_fused
from spmd_rl.trainer.iteration_metrics import IterationMetrics
from spmd_rl.trainer.ledger import StepRecord
from spmd_rl.trainer.metrics import StageTimer
from spmd_rl.trainer.partial import partial_round
from spmd_rl.trainer.runner import run_stage
from spmd_rl.trainer.stages import StageResult
from spmd_rl.trainer.stages.samples import put_prompts

log = logging.getLogger("spmd_rl")

Rounds = Callable[[Run, int, StageTimer, IterationMetrics], tuple[list[int], StepRecord]]


def rounds_for(run: Run) -> Rounds:
    """The run's strategy (module docstring), chosen once."""
    if run.modes.partial_rollout:
        return partial_round
    return dynamic_sampling if run.modes.dynamic_sampling else one_round


def _next_rows(run: Run, groups: int) -> list[int]:
    """The round's dataset rows: the sampler's next ``groups``, or with elastic replicas this
    replica's deal of the next global batch (``Replicas.deal``; ``groups`` is then its share)."""
    if run.replicas is None:
        return run.sampler.next_batch(groups)
    return run.replicas.deal(run.sampler.next_batch(run.replicas.global_batch))


def _round(run: Run, it: int, r: int, rows: list[int], put: list[int], timer: StageTimer, m) -> list[StageResult]:
    """Round ``r``: put its G prompt groups (appending to ``rows`` and ``put``: the dataset rows
    as the sampler handed them out and as the putters wrote them), then run the per-round
    stages, the rollout with the stages fused into it when ``stream.fuse``."""
    G, N = run.cfg.data.global_batch_size, run.cfg.rollout.n
    expected = list(range(r * G * N, (r + 1) * G * N))
    with timer.stage("prompts"):
        rows += _next_rows(run, G)
        put += put_prompts(run, it, rows[r * G :], first_group=r * G)
    inside = [run.graph[0], *run.fused] if run.fused else []
    results = run_fused(run, it, run.graph[0], run.fused, expected, timer) if run.fused else []
    results += [run_stage(run, it, s, expected, timer) for s in run.graph if s.per_round and s not in inside]
    for res in results:
        m.add(res)
    return results


def one_round(run: Run, it: int, timer: StageTimer, m: IterationMetrics) -> tuple[list[int], StepRecord]:
    rows: list[int] = []
    put: list[int] = []
    _round(run, it, 0, rows, put, timer, m)
    G, N = run.cfg.data.global_batch_size, run.cfg.rollout.n
    return list(range(G * N)), StepRecord(it, rows, [], put=put)  # trained: what the update reads (run_iteration)


def dynamic_sampling(run: Run, it: int, timer: StageTimer, m: IterationMetrics) -> tuple[list[int], StepRecord]:
    G, N = run.cfg.data.global_batch_size, run.cfg.rollout.n
    select = GroupSelection(G)
    rows: list[int] = []
    put: list[int] = []
    for r in range(run.modes.generation_rounds):
        results = _round(run, it, r, rows, put, timer, m)
        rewards = next(res.rewards for res in results if res.rewards is not None)
        dist.all_reduce(rewards)
        select.add_round(list(range(r * G, (r + 1) * G)), rewards, N)
        if select.done:
            break
    groups, short = select.final()
    if short and run.peer.rank == 0:
        log.warning(
            "dynamic sampling: only %d of %d groups carried signal after %d rounds; topped up with %d constant groups "
            "(raise algorithm.max_extra_rounds)",
            G - short,
            G,
            select.rounds,
            short,
        )
    m.final |= {
        "dapo_rounds": select.rounds,
        "dapo_kept_groups": G - short,
        "dapo_discarded_groups": select.rounds * G - G + short,
        "dapo_filler_groups": short,
    }
    kept, signal = set(groups), set(select.kept)
    dropped = {
        str(rows[q]): "dynamic sampling: "
        + ("beyond the iteration's G groups with signal" if q in signal else "constant reward in its group")
        for q in range(len(rows))
        if q not in kept
    }
    return [q * N + k for q in groups for k in range(N)], StepRecord(it, rows, [], dropped=dropped, put=put)
