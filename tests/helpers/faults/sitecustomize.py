"""Fault injection for the multi-process tests. Python imports this module at start-up when
this folder is on PYTHONPATH (torchrun's workers inherit it); it does nothing unless
$SPMD_RL_TEST_FAULTS holds a JSON plan and the process is a worker (``-m spmd_rl.train``), so
production code carries no test hooks.

Plans (``dir`` is a folder the test and the workers share):

- ``{"kind": "pause", "dir": D, "points": [...], "min_iteration": k}``: in a world of 2, at the
  first point (in order) without ``D/<point>.go``, from iteration k on: write
  ``D/<point>.reached`` and wait for the test to kill the other node and write
  ``D/<point>.go``, then carry on into that point. Points: ``generate`` (start of the generation
  stage), ``reward_fetch`` (the reward stage's fetch from the warehouses), ``update`` (start of
  the update), ``checkpoint`` (inside a checkpoint write, between its barriers). In a world of
  1 with ``D/hold`` present, every iteration after the worker's first waits (until the test
  grows the world, which restarts this worker).
- ``{"kind": "stop_warehouse", "iteration": k, "dir": D}``: in the first incarnation
  (TORCHELASTIC_RESTART_COUNT 0), the warehouse server thread stops when the first put of
  iteration k arrives, while its rank lives on; writes ``D/stopped`` with the time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _pause(plan: dict) -> None:
    import spmd_rl.trainer.loop as loop
    import spmd_rl.trainer.stages as stages
    from spmd_rl.dock.client import TransferDock
    from spmd_rl.engines.train import TrainEngine

    folder, points = Path(plan["dir"]), plan["points"]

    def at(point: str, iteration: int) -> None:
        pending = [p for p in points if not (folder / f"{p}.go").exists()]
        if os.environ.get("WORLD_SIZE") != "2" or not pending or pending[0] != point or iteration < plan["min_iteration"]:
            return
        (folder / f"{point}.reached").write_text(str(iteration))
        while not (folder / f"{point}.go").exists():
            time.sleep(0.05)

    def wrap(owner, name: str, point: str, iteration_of) -> None:
        original = getattr(owner, name)

        def hooked(*args, **kwargs):
            at(point, iteration_of(*args, **kwargs))
            return original(*args, **kwargs)

        setattr(owner, name, hooked)

    wrap(stages, "rollout", "generate", lambda run, it, *a, **k: it)
    wrap(loop, "update", "update", lambda run, it, *a, **k: it)
    wrap(TrainEngine, "save", "checkpoint", lambda engine, folder: int(Path(folder).name.split("_")[1].split(".")[0]))
    get, fetch = TransferDock.get, TransferDock._fetch

    def get_noting_stage(self, stage, *args, **kwargs):
        self._test_stage = stage
        return get(self, stage, *args, **kwargs)

    def fetch_paused(self, iteration, *args, **kwargs):
        if getattr(self, "_test_stage", None) == "reward":
            at("reward_fetch", iteration)
        return fetch(self, iteration, *args, **kwargs)

    TransferDock.get, TransferDock._fetch = get_noting_stage, fetch_paused
    run_iteration, done = loop.run_iteration, []

    def held(run, it, *args, **kwargs):
        while done and os.environ.get("WORLD_SIZE") == "1" and (folder / "hold").exists():
            time.sleep(0.1)
        done.append(it)
        return run_iteration(run, it, *args, **kwargs)

    loop.run_iteration = held


def _stop_warehouse(plan: dict) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    from spmd_rl.dock.warehouse import WarehouseServer

    handle = WarehouseServer._handle

    def stopping(self, frames, peer):
        replies = handle(self, frames, peer)
        if any(i >= plan["iteration"] for i in self.store.data) and not self._stop.is_set():
            (Path(plan["dir"]) / "stopped").write_text(str(time.time()))
            self._stop.set()  # the serve loop ends after this reply; the rank lives on
        return replies

    WarehouseServer._handle = stopping


_PLAN = os.environ.get("SPMD_RL_TEST_FAULTS")
if _PLAN and "spmd_rl.train" in sys.orig_argv:  # workers only, not the helpers they spawn (inductor's probes)
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck worker's stacks, on demand
    _plan = json.loads(_PLAN)
    {"pause": _pause, "stop_warehouse": _stop_warehouse}[_plan["kind"]](_plan)
