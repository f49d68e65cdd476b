"""Collective timeouts per phase. Start-up (model load, resume) can be skewed across ranks by
minutes on a real model, so it runs under ``elastic.startup_timeout_s``; iterations (and
checkpoint writes, where a lost peer must still be noticed quickly) run under
``elastic.collective_timeout_s``.

torch sets a group's timeout at creation; ``set_collective_timeout`` changes it for every
process group of this process (the default group and the device-mesh subgroups).
"""

from __future__ import annotations

import datetime

from torch.distributed import distributed_c10d as c10d


def set_collective_timeout(seconds: float) -> None:
    """Uses torch's ``_set_pg_timeout`` (private, present since torch 2.3) on every group."""
    timeout = datetime.timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timeout, group)
