"""Collective timeouts per phase. Start-up (model load, resume), checkpoint writes and
generation (greedy eval, the rollout rounds and the collectives right after them, which wait
for the slowest DP group's longest response) can be skewed across ranks by minutes on a real
model, so they run under ``elastic.startup_timeout_s``; the rest of an iteration runs under
``elastic.collective_timeout_s``. A dead
peer is noticed sooner than either through the liveness keys (``dock.heartbeat.PeerWatch``),
so the long phases cost nothing on a node loss.

torch sets a group's timeout at creation; ``set_collective_timeout`` changes it for every
process group of this process (the default group and the device-mesh subgroups) except those
made by ``group_with_own_timeout``, whose waits are bounded by something else (a replica's
ranks waiting for their lead to agree on a generation: ``elastic.startup_timeout_s``).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


_OWN_TIMEOUT: list = []
"""The groups ``set_collective_timeout`` leaves alone."""


def group_with_own_timeout(seconds: float, backend: str = "gloo"):
    """A new group of every rank (``dist.new_group``) whose timeout stays ``seconds``."""
    group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=seconds))
    _OWN_TIMEOUT.append(group)
    return group


def set_collective_timeout(seconds: float) -> None:
    """Uses torch's ``_set_pg_timeout`` (private, present since torch 2.3) on every group."""
    timeout = datetime.timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group) and not any(group is own for own in _OWN_TIMEOUT):
            c10d._set_pg_timeout(timeout, group)


@contextlib.contextmanager
def long_phase(seconds: float, steady_s: float) -> Iterator[None]:
    """Collectives inside run under ``seconds``; back to ``steady_s`` after (also on error)."""
    set_collective_timeout(seconds)
    try:
        yield
    finally:
        set_collective_timeout(steady_s)


def generation_phase(cfg) -> contextlib.AbstractContextManager[None]:
    """``long_phase`` with the config's ``elastic`` timeouts, for the generation part of an iteration."""
    return long_phase(cfg.elastic.startup_timeout_s, cfg.elastic.collective_timeout_s)
