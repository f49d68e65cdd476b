"""Separated placement (``parallel.placement: separated``): AsyncFlow's producer-consumer
workflow on the dock. The generators [0, gen_ranks) only generate, the trainers only train;
samples meet in the dock, and new weights travel by broadcast (``reshard.broadcast``).

Schedule, with k = ``stream.max_policy_lag`` and s the start iteration:

- the trainers publish their weights once at start (version s), and after the update of
  iteration i the weights of version i + 1 whenever a generator still needs them
  (i + 1 + k < trainer.iterations);
- before generating iteration i, a generator receives versions until it holds i - k.

So iteration i is generated with version max(s, i - k) and trained by update i: a lag of at
most k (checked on every update, ``stages.actor_update``), and generation of iterations
i + 1 .. i + k runs while iteration i trains. Both sides derive the same published set
{s + 1 .. iterations - 1 - k}, plus the final version ``iterations`` when
``eval.interval`` asks for held-out evaluation (the generators evaluate it and the
trainers log it as ``final_eval_accuracy``), so every broadcast has its receiver. The sides
share no other collective until the final barrier; each iteration's generator metrics (held-out accuracy,
generation time, version) reach the training leader through etcd next to the iteration's
put-records. The trainers' iteration (``train_half``) is the step of ``trainer.trainer.Trainer``,
whose loop logs, checkpoints and flushes traces for both placements.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable

import torch.distributed as dist

from spmd_rl.distributed import timeline
from spmd_rl.distributed.timeouts import generation_phase, long_phase
from spmd_rl.reshard import broadcast
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.evaluate import eval_due, evaluate
from spmd_rl.trainer.iteration_metrics import IterationMetrics, turn_metrics
from spmd_rl.trainer.ledger import StepRecord
from spmd_rl.trainer.metrics import StageTimer, global_maxes, global_sums, throughput
from spmd_rl.trainer.runner import run_stage
from spmd_rl.trainer.observed import trained_groups
from spmd_rl.trainer.stages.samples import put_prompts

log = logging.getLogger("spmd_rl")


def published(start: int, iterations: int, k: int, final: bool = False) -> list[int]:
    """The versions the trainers broadcast after an update: s + 1 .. iterations - 1 - k, and
    ``iterations`` (the final policy) when ``final`` (it is evaluated)."""
    return list(range(start + 1, iterations - k)) + ([iterations] if final else [])


def generation_version(it: int, start: int, k: int) -> int:
    """The policy version that generates iteration ``it``: max(s, it - k)."""
    return max(start, it - k)


def _waiting(run: Run):
    """A side waits on the other for up to a whole iteration: the long-phase timeout (a dead
    peer is still noticed within about the heartbeat TTL)."""
    return long_phase(run.cfg.elastic.startup_timeout_s, run.cfg.elastic.collective_timeout_s)


def publish(run: Run, version: int) -> None:
    """Every trainer: gather the actor's weights; the leader broadcasts them and records the digest."""
    s, res = run.sides, run.residency
    res.enter("publish", ("actor",))
    with _waiting(run):
        sent = broadcast.send(
            version,
            res.resharder.weight_meta(),
            res.resharder.full_weights(),
            run.cfg.reshard.bucket_bytes,
            s.train_leader,
            s.sync_group,
            run.acc.device,
            run.peer.rank == s.train_leader,
        )
    if sent is not None and run.ledger is not None:
        run.ledger.record_weights(version, "sent", sent)


def receive(run: Run) -> None:
    """A generator: stream the next published version into its engine (one bucket at a time);
    the side's leader records the digest of what arrived."""
    s = run.sides
    with _waiting(run):
        version, meta, weights = broadcast.receive(
            run.cfg.reshard.bucket_bytes, s.train_leader, s.sync_group, run.acc.device
        )
        if version <= run.progress.policy_version:
            raise RuntimeError(
                f"received policy version {version} after {run.progress.policy_version}: versions must increase"
            )
        h = hashlib.sha256()
        run.rollout.update_weights(broadcast.hashed(weights, h), meta)
    if run.peer.rank == s.leader and run.ledger is not None:
        run.ledger.record_weights(version, f"received-{run.peer.rank}", h.hexdigest())
    run.progress.policy_version = version


def _generator_key(run: Run, it: int) -> str:
    return run.dock.meta.key(it, "generator")


def generate(run: Run, start: int) -> None:
    """The generators' loop (module docstring)."""
    cfg, leader = run.cfg, run.peer.rank == run.sides.leader
    G, N, k = cfg.data.global_batch_size, cfg.rollout.n, cfg.stream.max_policy_lag
    run.progress.policy_version = -1  # nothing received yet: the engine holds the base model, not version `start`
    receive(run)
    for it in range(start, cfg.trainer.iterations):
        t0 = timeline.now_us()
        with timeline.span("receive_weights", "stage"):
            while run.progress.policy_version < generation_version(it, start, k):
                receive(run)
        timer, out = StageTimer(), {"gen_version": float(run.progress.policy_version)}
        run.dock.begin_iteration(it, G * N)
        if eval_due(run, it):
            with timer.stage("eval"), generation_phase(cfg):  # its sum waits for the slowest generator
                out |= evaluate(run, it)
        with timer.stage("prompts"):
            put = put_prompts(run, it, run.sampler.next_batch(G))
        res = run_stage(run, it, run.graph[0], list(range(G * N)), timer)
        out |= turn_metrics(global_sums(res.sums, run.sides.group))  # multi-turn counts, summed over the generators
        with timeline.span("commit", "stage"):
            run.dock.release(it)
            if leader:
                report = out | {f"time_{n}": v for n, v in timer.times.items()} | {"put_rows": put}
                run.dock.meta.put(_generator_key(run, it), json.dumps(report).encode())
        timeline.flush(cfg.logging.dir, run.peer.rank, it, t0)
    if run.held_out is not None:  # the final policy (module docstring)
        receive(run)
        with generation_phase(cfg):
            final = evaluate(run, cfg.trainer.iterations, prefix="final_eval")
        if leader:
            run.dock.meta.put(
                _generator_key(run, cfg.trainer.iterations), json.dumps(final | {"put_rows": []}).encode()
            )
    with _waiting(run):
        dist.barrier()


def _generator_report(run: Run, it: int) -> tuple[dict[str, float], list[int]]:
    """The generators' metrics of iteration ``it``, written right after its samples, and the
    rows their putters wrote (the ledger's ``put``)."""
    deadline = time.monotonic() + run.cfg.dock.get_timeout_s
    while (raw := run.dock.meta.get(_generator_key(run, it))) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the generators wrote no metrics for iteration {it} within dock.get_timeout_s")
        time.sleep(0.01)
    report = json.loads(raw)
    put = report.pop("put_rows")
    return {k: float(v) for k, v in report.items()}, put


def finish(run: Run) -> None:
    """A trainer after its last iteration: meet the generators' final barrier (``generate``)."""
    with _waiting(run):
        dist.barrier()


def train_half(run: Run, start: int, it: int, on_stage: Callable[[str], None]) -> dict[str, float]:
    """The trainers' half of iteration ``it`` (the ``Trainer``'s step; ``publish`` ran before
    the first): the stages after the rollout on the groups the generators put, the commit (with
    the generators' report), and the weights published."""
    cfg, leader = run.cfg, run.peer.rank == run.sides.leader
    G, N, k = cfg.data.global_batch_size, cfg.rollout.n, cfg.stream.max_policy_lag
    t0, timer, m = time.perf_counter(), StageTimer(on_stage), IterationMetrics(run.sides.group)
    run.dock.begin_iteration(it, G * N)
    rows = run.sampler.next_batch(G)  # what the generators should have drawn: the same sampler, the same order
    consumed: list[tuple[int, int]] = []
    for stage in run.graph[1:]:
        res = run_stage(run, it, stage, list(range(G * N)), timer)
        m.add(res)
        consumed += res.consumed or []
    trained, read = trained_groups(consumed, G * N, N, run.sides.group)  # observed in the dock (trainer.observed)
    with timeline.span("commit", "stage"):
        out = m.finish()
        dist.barrier(group=run.sides.group)
        gen, put = _generator_report(run, it) if leader else ({}, [])
        if leader:
            run.dock.commit(it, alone=True)
            if run.ledger is not None:
                run.ledger.record(
                    StepRecord(
                        it, rows, trained, version=int(gen["gen_version"]), put=put, trained_samples=read, group_size=N
                    )
                )
        else:
            run.dock.release(it)
    if it + 1 in published(start, cfg.trainer.iterations, k, final=bool(cfg.eval.interval)):
        with timer.stage("publish"):
            publish(run, it + 1)
    if it + 1 == cfg.trainer.iterations and cfg.eval.interval and leader:
        gen |= _generator_report(run, it + 1)[0]  # the generators' final_eval_accuracy
    seconds = time.perf_counter() - t0
    out |= gen | {"world": run.lay.world, "samples": G * N, "iteration_s": seconds}
    out |= global_maxes(run.residency.iteration_memory([s.name for s in run.graph[1:]]), run.sides.group)
    out["throughput_eq5"] = throughput(
        G, N, cfg.data.max_prompt_length, cfg.rollout.max_response_length, run.lay.world, seconds
    )
    return out | {f"time_{n}": v for n, v in timer.times.items()}
