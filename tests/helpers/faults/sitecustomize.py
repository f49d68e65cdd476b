"""Fault injection for the multi-process tests. Python imports this module at start-up when
this folder is on PYTHONPATH (torchrun's workers inherit it); it does nothing unless
$SPMD_RL_TEST_FAULTS holds a JSON plan and the process is a worker (``-m spmd_rl.train``), so
production code carries no test hooks.

The plan is applied where the worker's first statement, ``preload.delegate``, returns: in the
process that runs the program (a fresh worker, or the copy a preload server forked, which runs
this module again with the worker's environment), never in a stub whose copy runs it (it
would import the modules the copy is forked past). The suite puts this folder on every
subprocess's PYTHONPATH (``conftest.subprocess_env``), the preload servers' included.

Plans (``dir`` is a folder the test and the workers share):

- ``{"kind": "pause", "dir": D, "points": [...], "min_iteration": k, "world": w}`` (points:
  generate, reference, update, commit, heal, checkpoint, reward_fetch, ledger: before the
  ledger record of a committed iteration is written): in a world
  of w (default 2; 1 for an elastic replica of one rank, whose peers are other jobs), at the
  first point (in order) without ``D/<point>.go``, from iteration k on: write
  ``D/<point>.reached`` (JSON: the iteration and this worker's pid) and wait for the test to
  kill the other node and write ``D/<point>.go``, then carry on into that point (with
  ``"skip": s``, the first s arrivals there carry on at once: the commit of an iteration's
  second mini-batch is its arrival 1). Points:
  ``generate`` (start of the generation stage), ``reward_fetch`` (the reward stage's fetch from
  the warehouses), ``reference`` (start of the reference log-prob stage), ``update`` (start of
  the update), ``commit`` (an elastic replica, world 1: after the gradient's all-reduce over the
  replicas, before the commit vote), ``heal`` (an elastic replica: before it sends or receives a
  joiner's state; its iteration is its last update's), ``checkpoint`` (inside a checkpoint write, between its
  barriers). In a world of 1 with ``D/hold`` present, every iteration after the
  worker's first waits (until the test grows the world, which restarts this worker), and
  writes ``D/held.<pid>`` (the iteration) as it starts waiting. An elastic replica (world 1)
  also appends "n prompts" to ``D/generated.<pid>`` for every request of groups to its engine.
- ``{"kind": "dump", "dir": D}``: every dock put of the worker is also saved as
  ``D/put_rank<r>_<n>.pt`` (stage, iteration, indices, columns; read back with
  ``torch.load(weights_only=True)``), and every residency-ledger row is appended to
  ``D/ledger_rank<r>.jsonl`` (phase, bytes by category). With routes recorded, also each
  request's routes as the rollout engine took them from vLLM (``D/vllm_routes_rank<r>_<n>.pt``:
  context, responses, routes) and every sequence batch a stage built with routes
  (``D/read_routes_rank<r>_<n>.pt``: prompts, responses, routes as read from the dock).
- ``{"kind": "desync", "rank": r}``: the sampler of global rank r skips its first prompt
  position once, as a rank whose data order drifted from the others' would (the prompt
  ledger must see it: a putter writes rows the leader's sampler never handed out).
- ``{"kind": "slow_generate", "rank": r, "seconds": s}``: every generation call of global rank
  r's rollout engine (``generate``, ``continue_samples``) first sleeps s seconds, as the DP
  group with the longest responses would.
- ``{"kind": "split_commit", "iteration": k}``: an elastic replica's first commit vote of
  iteration k completes on its peers and fails on it (its group aborted).
- ``{"kind": "stop_warehouse", "iteration": k, "dir": D}``: in the first incarnation
  (TORCHELASTIC_RESTART_COUNT 0), the warehouse server thread stops when the first put of
  iteration k arrives, while its rank lives on; writes ``D/stopped`` with the time.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import time
from pathlib import Path


def _pause(plan: dict) -> None:
    import spmd_rl.trainer.trainer as loop
    from spmd_rl.dock.client import TransferDock
    from spmd_rl.trainer.stages import REGISTRY
    from spmd_rl.engines.fsdp.engine import TrainEngine

    folder, points = Path(plan["dir"]), plan["points"]
    skipped = [0]

    def at(point: str, iteration: int) -> None:
        pending = [p for p in points if not (folder / f"{p}.go").exists()]
        if (
            os.environ.get("WORLD_SIZE") != str(plan.get("world", 2))
            or not pending
            or pending[0] != point
            or iteration < plan["min_iteration"]
        ):
            return
        if skipped[0] < plan.get("skip", 0):
            skipped[0] += 1
            return
        # the pid: the test looks the paused worker up among the preload servers' copies
        (folder / f"{point}.reached").write_text(json.dumps({"iteration": iteration, "pid": os.getpid()}))
        while not (folder / f"{point}.go").exists():
            time.sleep(0.05)

    def wrap(owner, name: str, point: str, iteration_of) -> None:
        original = owner[name] if isinstance(owner, dict) else getattr(owner, name)

        def hooked(*args, **kwargs):
            at(point, iteration_of(*args, **kwargs))
            return original(*args, **kwargs)

        if isinstance(owner, dict):
            owner[name] = hooked
        else:
            setattr(owner, name, hooked)

    updating = [0]  # the iteration of the last update started (the commit point's)

    def update_of(call) -> int:
        updating[0] = call.it
        return call.it

    wrap(REGISTRY, "actor_rollout", "generate", lambda call: call.it)
    wrap(REGISTRY, "ref_logprob", "reference", lambda call: call.it)
    wrap(REGISTRY, "actor_update", "update", update_of)
    if plan.get("world") == 1:  # an elastic replica
        from spmd_rl.elastic.replica_group import ReplicaGroup

        _count_generated(folder)
        wrap(ReplicaGroup, "should_commit", "commit", lambda *args: updating[0])
        wrap(ReplicaGroup, "heal", "heal", lambda *args: updating[0])

    # the checkpoint's iteration from its folder: .../iter_000012.tmp[/critic]
    wrap(
        TrainEngine,
        "save",
        "checkpoint",
        lambda _, f, *group: int(next(p for p in reversed(Path(f).parts) if p.startswith("iter_"))[5:11]),
    )
    wrap(
        importlib.import_module("spmd_rl.trainer.ledger").PromptLedger, "record", "ledger", lambda _, rec: rec.iteration
    )
    get, fetch = TransferDock.get, TransferDock.fetch

    def get_noting_stage(self, stage, *args, **kwargs):
        self._test_stage = stage
        return get(self, stage, *args, **kwargs)

    def fetch_paused(self, iteration, *args, **kwargs):
        if getattr(self, "_test_stage", None) == "reward":
            at("reward_fetch", iteration)
        return fetch(self, iteration, *args, **kwargs)

    TransferDock.get, TransferDock.fetch = get_noting_stage, fetch_paused
    run_iteration, done = loop.run_iteration, []

    def held(run, it, *args, **kwargs):
        if done and os.environ.get("WORLD_SIZE") == "1" and (folder / "hold").exists():
            (folder / f"held.{os.getpid()}").write_text(str(it))  # the test sees who waits where
        while done and os.environ.get("WORLD_SIZE") == "1" and (folder / "hold").exists():
            time.sleep(0.1)
        done.append(it)
        return run_iteration(run, it, *args, **kwargs)

    loop.run_iteration = held


def _count_generated(folder: Path) -> None:
    """Append "n prompts" to ``folder/generated.<pid>`` for every request of groups to the rollout
    engine: what a replica generated, seen from the engine rather than from its own counters."""
    from spmd_rl.engines.base import Rollout

    stream = Rollout.generate_stream

    def counted(self, prompts, n, *args, **kwargs):
        with open(folder / f"generated.{os.getpid()}", "a") as f:
            f.write(f"{n} {len(prompts)}\n")
        return stream(self, prompts, n, *args, **kwargs)

    Rollout.generate_stream = counted


def _dump(plan: dict) -> None:
    import torch

    from spmd_rl.dock.client import TransferDock
    from spmd_rl.reshard.residency import Residency

    folder, rank = Path(plan["dir"]), os.environ.get("RANK", "0")
    folder.mkdir(parents=True, exist_ok=True)
    put, record, count = TransferDock.put, Residency.record, [0]

    def put_saving(self, stage, iteration, data, indices):
        idx = indices.tolist() if hasattr(indices, "tolist") else list(indices)
        cols = {k: [t.clone() for t in v] if isinstance(v, list) else v.clone() for k, v in data.items()}
        torch.save(
            {"stage": stage, "iteration": iteration, "indices": idx, "columns": cols},
            folder / f"put_rank{rank}_{count[0]}.pt",
        )
        count[0] += 1
        return put(self, stage, iteration, data, indices)

    def record_saving(self, phase):
        record(self, phase)
        with open(folder / f"ledger_rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"phase": phase, **self.ledger.rows[-1][1]}) + "\n")

    TransferDock.put, Residency.record = put_saving, record_saving
    _dump_routes(folder, rank)


def _dump_routes(folder: Path, rank: str) -> None:
    import torch

    from spmd_rl.engines.training import logprobs
    from spmd_rl.engines.vllm.engine import VllmRollout
    from spmd_rl.trainer.stages import samples

    taken, build, count = VllmRollout._routes, logprobs.build_batch, [0, 0]

    def routes_saving(self, context, outputs, rid, n):
        got = taken(self, context, outputs, rid, n)
        torch.save(
            {
                "context": list(context),
                "responses": [list(c.token_ids) for c in outputs],
                "routes": [r.clone() for r in got],
            },
            folder / f"vllm_routes_rank{rank}_{count[0]}.pt",
        )
        count[0] += 1
        return got

    def build_saving(prompts, responses, pad_id, routes=None, route_shape=None, sampled=None):
        if routes is not None:
            torch.save(
                {
                    "prompts": [p.clone() for p in prompts],
                    "responses": [r.clone() for r in responses],
                    "routes": [r.clone() for r in routes],
                },
                folder / f"read_routes_rank{rank}_{count[1]}.pt",
            )
            count[1] += 1
        return build(prompts, responses, pad_id, routes, route_shape, sampled)

    VllmRollout._routes = routes_saving
    samples.build_batch = build_saving


def _desync(plan: dict) -> None:
    from spmd_rl.data.sampler import PromptSampler

    if os.environ.get("RANK") != str(plan["rank"]):
        return
    original, skipped = PromptSampler.next_batch, []

    def drifted(self, n):
        if not skipped:
            skipped.append(original(self, 1))
        return original(self, n)

    PromptSampler.next_batch = drifted


def _slow_generate(plan: dict) -> None:
    if os.environ.get("RANK") != str(plan["rank"]):
        return
    from spmd_rl.engines.vllm.engine import VllmRollout

    def slowed(original):
        def call(*args, **kwargs):
            time.sleep(plan["seconds"])
            return original(*args, **kwargs)

        return call

    VllmRollout.generate = slowed(VllmRollout.generate)
    VllmRollout.continue_samples = slowed(VllmRollout.continue_samples)


def _stop_warehouse(plan: dict) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    from spmd_rl.dock.warehouse import WarehouseServer

    handle = WarehouseServer._handle

    def stopping(self, frames, peer, ident=None):
        replies = handle(self, frames, peer, ident)
        if any(i >= plan["iteration"] for i in self.store.data) and not self._stop.is_set():
            (Path(plan["dir"]) / "stopped").write_text(str(time.time()))
            self._stop.set()  # the serve loop ends after this reply; the rank lives on
        return replies

    WarehouseServer._handle = stopping


def _split_commit(plan: dict) -> None:
    """The first commit vote of iteration ``plan["iteration"]`` on this elastic replica reaches
    the others (the MIN all-reduce completes, so they step) and fails here, as a vote whose last
    receive was cut would: the group is aborted and the vote answers False."""
    from spmd_rl.elastic.replica_group import ReplicaGroup
    from spmd_rl.trainer.stages import REGISTRY

    vote, update, state = ReplicaGroup.should_commit, REGISTRY["actor_update"], {"it": -1, "done": False}

    def noting(call):
        state["it"] = call.it
        return update(call)

    def cut(self, ok=True):
        agreed = vote(self, ok)
        if agreed and not state["done"] and state["it"] >= plan["iteration"]:
            state["done"] = True
            self.pg.abort()
            return False
        return agreed

    REGISTRY["actor_update"], ReplicaGroup.should_commit = noting, cut


_PLAN = os.environ.get("SPMD_RL_TEST_FAULTS")
if _PLAN and "spmd_rl.train" in sys.orig_argv:  # workers only, not the helpers they spawn (inductor's probes)
    import faulthandler
    import signal

    from spmd_rl.launcher import preload

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck worker's stacks, on demand
    _plan = json.loads(_PLAN)
    _apply = {
        "pause": _pause,
        "stop_warehouse": _stop_warehouse,
        "dump": _dump,
        "desync": _desync,
        "slow_generate": _slow_generate,
        "split_commit": _split_commit,
    }[_plan["kind"]]
    _delegate = getattr(preload.delegate, "__wrapped__", preload.delegate)  # once, however often this runs

    @functools.wraps(_delegate)
    def _delegate_then_apply(*args, **kwargs):
        _delegate(*args, **kwargs)  # returns only where this process runs the program
        _apply(_plan)

    preload.delegate = _delegate_then_apply
