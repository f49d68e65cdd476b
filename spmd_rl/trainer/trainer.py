"""One rank's trainer, in torchtitan's shape: ``Trainer(cfg, peer)`` builds the run, ``train()``
runs its iterations and ``step(it)`` runs one.

    Trainer(cfg, peer)             # the parts of trainer.build, in order: layouts and process
                                   # group, etcd and dock, sides, data, rollout engine, training
                                   # roles, resume, replicas; then the strategies, chosen once
    train():
        for it in [start, trainer.iterations):
            metrics = step(it)     # the placement's iteration
            log metrics            # the side's leader: MetricsLog, the progress bar
            [checkpoint]           # every checkpoint.interval, and after the last
            flush this rank's trace

The strategies, chosen once at construction (``_iteration``), never checked along the way:

- placement: colocated, every rank runs every stage (``colocated_iteration`` below); or
  separated (``trainer.async_loop``): the generators run their own loop and never call
  ``step``, the trainers' ``step`` is ``async_loop.train_half``;
- the rounds before the update (``trainer.rounds``): one round, DAPO's dynamic sampling, or a
  partial rollout's round;
- elastic replicas wrap the colocated iteration (``trainer.replica_loop.replicated_iteration``).

The colocated iteration (paper Figure 1), identical on every rank: for each stage of the declared
graph (``recipe.graph``), make its roles resident and run it (``trainer.runner.run_stage``).

    [eval] -> (prompts -> actor_rollout -> reward) x rounds -> [ref_logprob] -> [actor_logprob]
           -> [critic_value] -> advantage -> [critic_update] -> actor_update -> commit
           -> [final eval, after the last iteration] -> [checkpoint]

With ``stream.fuse`` the fused stages (``recipe.graph.fused_stages``) run inside the rollout on
the groups already generated (``trainer.fusion``) and are not run again after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch.distributed as dist

from spmd_rl.config.schema import Config
from spmd_rl.data.preferences import preferences_for
from spmd_rl.data.prompts import load_tokenizer, prompts_for
from spmd_rl.data.sampler import sampler_for
from spmd_rl.distributed import timeline
from spmd_rl.distributed.mesh import replica_group, train_mesh
from spmd_rl.distributed.sides import init_sides
from spmd_rl.distributed.timeouts import generation_phase, long_phase, set_collective_timeout
from spmd_rl.dock.client import TransferDock
from spmd_rl.dock.columns import specs_of
from spmd_rl.dock.fetch import Peer
from spmd_rl.recipe.columns import column_decls
from spmd_rl.recipe.graph import Modes, pinned_roles, stages_for
from spmd_rl.reshard.allgather_swap import Resharder
from spmd_rl.reshard.residency import Residency
from spmd_rl.rewards import reward_for
from spmd_rl.trainer import async_loop, build, checkpoint
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.evaluate import eval_due, evaluate, held_out_for
from spmd_rl.trainer.offline_eval import recorded_config
from spmd_rl.trainer.iteration_metrics import IterationMetrics
from spmd_rl.trainer.ledger import PromptLedger
from spmd_rl.trainer.metrics import MetricsLog, StageTimer, global_maxes, throughput, truncate_from
from spmd_rl.trainer.observed import trained_groups
from spmd_rl.trainer.partial import carried_rows, restore_carry
from spmd_rl.trainer.progress import progress_for
from spmd_rl.trainer.replica_loop import replicated_iteration
from spmd_rl.trainer.rounds import Rounds, rounds_for
from spmd_rl.trainer.runner import run_stage

log = logging.getLogger("spmd_rl")

OnStage = Callable[[str], None]
"""Called with each stage's name as it starts (the progress bar)."""


class Trainer:
    def __init__(self, cfg: Config, peer: Peer, before_init: Callable[[], None] = lambda: None) -> None:
        """Every rank: check the config, join the process group and the job's etcd and dock,
        build the rollout engine and the training roles, resume from the last checkpoint, and
        choose the strategies (module docstring). ``before_init``: see ``build.start_process_group``."""
        lay, acc = build.start_process_group(cfg, peer, before_init)
        endpoints, meta, token = build.metadata(cfg, peer)
        modes, graph = Modes.of(cfg), stages_for(cfg)
        dock = TransferDock(cfg.dock, meta, specs_of(column_decls(graph)), peer, token)
        dock.start(cfg.elastic.heartbeat_ttl_s)
        sides = init_sides(lay, peer.rank)  # separated: "gen" hosts only vLLM, "train" only the training roles
        tok = load_tokenizer(cfg)
        data_for = preferences_for if modes.algorithm.advantage == "preference" else prompts_for
        prompts = data_for(cfg, tok, cfg.data.train_path)
        generates = any("rollout" in s.roles for s in graph)  # DPO generates nothing
        rollout = build.build_rollout(cfg, modes, acc, lay, peer, sides.side) if generates else None
        roles = build.build_roles(cfg, modes, acc, train_mesh(acc, lay.train), graph) if sides.side != "gen" else {}
        build.check_accumulation_fits(cfg, acc, lay, roles)
        sampler = sampler_for(cfg, len(prompts))
        state, start = build.resume(cfg, peer, roles, sampler, sides.group)
        replicas, start = build.replicas_of(cfg, endpoints, lay, roles, peer, sampler, start)
        resharder = Resharder(roles.get("actor"), rollout, cfg.reshard, cfg.model.dtype, acc)
        self.run = run = Run(
            cfg=cfg,
            lay=lay,
            peer=peer,
            acc=acc,
            dock=dock,
            sides=sides,
            modes=modes,
            graph=graph,
            roles=roles,
            rollout=rollout,
            residency=Residency(resharder, roles, pinned_roles(cfg)),
            tokenizer=tok,
            prompts=prompts,
            sampler=sampler,
            reward_fn=reward_for(cfg.reward),
            lineage=checkpoint.lineage_id(state, cfg.checkpoint.resume),
            held_out=held_out_for(cfg, tok) if cfg.eval.interval and rollout is not None else None,
            ledger=PromptLedger(
                build.store(cfg.metadata, endpoints, build.dock_job(cfg.metadata, cfg.elastic, ".ledger"))
            ),
            # the TP ranks of a generation group run each multi-turn rollout together
            gen_tp_group=replica_group(lay.gen, peer.rank) if modes.multi_turn and lay.gen.tp > 1 else None,
            replicas=replicas,
        )
        self.start = start
        if state is not None and "carry_rows" in state:
            restore_carry(run, state["carry_rows"])
        if peer.rank == 0:
            run.ledger.restart_at(start)  # the iterations from `start` on are (re)done from here
        self._iteration = self._strategy()
        dist.barrier()  # every rank has loaded and resumed: from here on, the steady-state timeout
        set_collective_timeout(cfg.elastic.collective_timeout_s)
        dock.watch_peers(build.peer_lost)
        if peer.rank == 0:
            log.info("training from iteration %d with world %d", start, peer.world)

    def _strategy(self) -> Callable[[int, OnStage], dict[str, float]]:
        """The placement's iteration with its rounds and replicas, chosen once (module docstring)."""
        run = self.run
        if run.sides.side == "gen":
            return _never_stepped
        if run.sides.side == "train":
            return partial(async_loop.train_half, run, self.start)
        colocated = partial(colocated_iteration, rounds=rounds_for(run))
        if run.replicas is not None:  # redone by the survivors when a replica is lost
            return partial(replicated_iteration, run, iteration=colocated)
        return partial(colocated, run)

    def step(self, it: int, on_stage: OnStage = lambda _: None) -> dict[str, float]:
        """Collective: iteration ``it`` of the chosen placement; its metrics."""
        return self._iteration(it, on_stage)

    def train(self) -> None:
        """This rank's part of the run (module docstring); a generator of the separated
        placement runs the generators' loop instead (``async_loop.generate``)."""
        run, cfg, start = self.run, self.run.cfg, self.start
        # a resumed run redoes the iterations from start: each rank drops their spans, as the
        # leader drops their metrics lines (MetricsLog), so the trace shows each iteration once
        truncate_from(Path(cfg.logging.dir) / "trace" / f"rank{run.peer.rank}.jsonl", start)
        if run.sides.side == "gen":
            return async_loop.generate(run, start)
        if run.sides.side == "train":
            async_loop.publish(run, start)  # the weights the generators start from
        leader = run.peer.rank == run.sides.leader
        metrics = MetricsLog(
            cfg.logging.dir,
            cfg.logging.jsonl,
            cfg.logging.tensorboard,
            enabled=leader,
            start_iteration=start,
            wandb=cfg.logging.wandb,
            job=cfg.metadata.job,
            lineage=run.lineage,
            config=cfg.model_dump(mode="json", exclude={"dock": {"token"}}),
        )
        bar = progress_for(leader and cfg.logging.progress, cfg.trainer.iterations, start)
        for it in range(start, cfg.trainer.iterations):
            start_us = timeline.now_us()
            m = self.step(it, bar.stage)
            with timeline.span("log", "stage"):
                metrics.write(it, m)
                bar.iteration_done(it, m)
            trace = partial(timeline.flush, cfg.logging.dir, run.peer.rank, it, start_us)
            every = cfg.checkpoint.interval
            if (every and (it + 1) % every == 0) or it + 1 == cfg.trainer.iterations:
                bar.stage("checkpoint")
                self.checkpoint(it + 1, before_commit=partial(_trace_with_checkpoint, trace, timeline.now_us()))
            else:
                trace()
        bar.close()
        metrics.close()
        if run.sides.side == "train":
            async_loop.finish(run)

    def checkpoint(self, iteration: int, before_commit: Callable[[], None] | None = None) -> None:
        """Collective over the training roles: the checkpoint after ``iteration`` updates (the
        roles' state, the sampler, the RNGs, a partial rollout's carried rows); ``before_commit``:
        see ``checkpoint.save``."""
        run, cfg = self.run, self.run.cfg
        state = {
            "iteration": iteration,
            "origin": checkpoint.origin_of(cfg.checkpoint.resume),
            "lineage": run.lineage,
            "sampler": {"epoch": run.sampler.state.epoch, "offset": run.sampler.state.offset},
            "rng": checkpoint.rng_state(),
            "model_path": cfg.model.path,
            "tokenizer_path": cfg.model.tokenizer_path or cfg.model.path,
            "config": recorded_config(cfg),  # what `spmd-rl eval` of this checkpoint applies
        }
        if cfg.actor.lora is not None:  # the actor's state is its adapters (export merges or writes them)
            state["lora"] = cfg.actor.lora.model_dump()
        if run.modes.partial_rollout:
            state["carry_rows"] = carried_rows(run)
        run.residency.enter("checkpoint", checkpoint.SAVED_ROLES)
        with long_phase(cfg.elastic.startup_timeout_s, cfg.elastic.collective_timeout_s):  # writes skew by minutes
            folder = checkpoint.save(
                cfg.checkpoint.dir,
                iteration,
                run.roles,
                state,
                cfg.checkpoint.keep,
                before_commit,
                group=run.sides.group,
                leader=run.sides.leader,
            )
        if run.peer.rank == run.sides.leader:
            log.info("saved checkpoint %s", folder)

    def close(self) -> None:
        """Leave the replicas and the dock (every rank, also after an error)."""
        if self.run.replicas is not None:
            self.run.replicas.close()
        self.run.dock.close()


def _never_stepped(it: int, on_stage: OnStage) -> dict[str, float]:
    raise RuntimeError("a generator of the separated placement runs async_loop.generate, never Trainer.step")


def _trace_with_checkpoint(trace: Callable[[], None], t0: int) -> None:
    """The iteration's trace line is on disk before its checkpoint completes: a kill in between
    resumes after this iteration and would never write its line again."""
    timeline.record("checkpoint", "stage", t0)
    trace()


def colocated_iteration(run: Run, it: int, on_stage: OnStage, rounds: Rounds) -> dict[str, float]:
    """One iteration on every rank (module docstring), and after the last the final held-out
    evaluation; ``rounds``: the run's strategy (``rounds_for``)."""
    m = run_iteration(run, it, on_stage, rounds)
    if it + 1 == run.cfg.trainer.iterations and run.held_out is not None:
        on_stage("eval")
        with timeline.span("eval", "stage"), generation_phase(run.cfg):
            # the weights the last checkpoint holds, logged on the last iteration's row
            run.residency.enter("eval", ("rollout",))  # syncs the updated weights into the engine
            m |= evaluate(run, run.cfg.trainer.iterations, prefix="final_eval")
    return m


def run_iteration(run: Run, it: int, on_stage: OnStage | None, rounds: Rounds) -> dict[str, float]:
    """The stages of one colocated iteration, the commit and the metrics (module docstring)."""
    cfg, timer, m = run.cfg, StageTimer(on_stage), IterationMetrics(run.sides.group)
    t0 = time.perf_counter()
    size = run.modes.generation_rounds * cfg.data.global_batch_size * cfg.rollout.n
    with timeline.span("begin", "stage"):
        run.dock.begin_iteration(it, size)
    with generation_phase(cfg):  # the collectives after generation wait for the slowest DP group
        if eval_due(run, it):
            with timer.stage("eval"):
                run.residency.enter("eval", ("rollout",))
                m.final |= evaluate(run, it)
        train_idx, record = rounds(run, it, timer, m)
    if not train_idx and run.peer.rank == 0:
        log.warning("iteration %d: no prompt group finished within stream.partial_tokens; no update", it)
    consumed: list[tuple[int, int]] = []
    for stage in run.graph:
        if train_idx and not stage.per_round and stage not in run.fused:
            res = run_stage(run, it, stage, train_idx, timer)
            m.add(res)
            consumed += res.consumed or []
    # the ledger's "trained" is what the update read, not the selection above (trainer.observed)
    record.trained, record.trained_samples = trained_groups(consumed, size, cfg.rollout.n, run.sides.group)
    record.group_size = cfg.rollout.n
    with timeline.span("commit", "stage"):
        dist.barrier()
        run.dock.commit(it)
        if run.ledger is not None and run.peer.rank == 0:
            run.ledger.record(record)
    seconds = time.perf_counter() - t0
    with timeline.span("metrics", "stage"):
        out = m.finish() | {"world": run.lay.world, "samples": len(train_idx), "iteration_s": seconds}
        ran = [s.name for s in run.graph if s.name in timer.times]  # partial rollout may train nothing
        # the largest rank's memory; the slowest and fastest rank's rollout stage (their gap is how
        # long the fastest waited: the most a better balance of the generation work could save)
        gen_s = timer.times.get(run.graph[0].name, 0.0)
        memory = run.residency.iteration_memory(ran) | {"generation_s_max": gen_s}
        out |= global_maxes(memory, run.sides.group, mins={"generation_s_min": gen_s})
        G, N, PL, SL = (
            cfg.data.global_batch_size,
            cfg.rollout.n,
            cfg.data.max_prompt_length,
            cfg.rollout.max_response_length,
        )
        out["throughput_eq5"] = throughput(G, N, PL, SL, run.lay.world, seconds)
        return out | {f"time_{k}": v for k, v in timer.times.items()}
