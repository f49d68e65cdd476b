"""A generation group's TP ranks run one multi-turn rollout together: vLLM's TP ranks must submit
the same requests at the same engine step, but a tool finishes when it finishes. So only TP rank 0
(the leader) runs the environments, and after every engine step it broadcasts what its tools
decided; the other ranks apply the same decisions to their copies of the trajectories.

Payload (int64): [tools still pending, decision count, then per decision: trajectory key,
status, inserted token count, the inserted tokens]. Status ``GO``: the observation's tokens are
inserted and the next turn is submitted now; ``PAUSE``: inserted, and the trajectory waits for
the next iteration (partial rollout); ``END``: the trajectory is done.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmd_rl.envs.trajectory import Trajectory

END, GO, PAUSE = 0, 1, 2


def share(
    decisions: list[tuple[Trajectory, list[int], int]], pending: bool, trajs: list[Trajectory], group=None
) -> tuple[list[Trajectory], bool]:
    """(the trajectories that go on now, whether the leader still waits on tools), the same on
    every rank of ``group``; the leader passes its decisions (already applied to its
    trajectories), the others receive and apply them. No group: the decisions as they are."""
    if group is None:
        return [t for t, _, status in decisions if status == GO], pending
    leader = dist.get_global_rank(group, 0)
    if dist.get_rank() == leader:
        flat = [int(pending), len(decisions)] + [
            x for t, ins, status in decisions for x in (t.key, status, len(ins), *ins)
        ]
        size = torch.tensor([len(flat)], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, leader, group=group)
    buf = (
        torch.tensor(flat, dtype=torch.int64)
        if dist.get_rank() == leader
        else torch.zeros(int(size), dtype=torch.int64)
    )
    dist.broadcast(buf, leader, group=group)
    if dist.get_rank() == leader:
        return [t for t, _, status in decisions if status == GO], pending
    v = buf.tolist()
    going, j = [], 2
    for _ in range(v[1]):
        key, status, n = v[j : j + 3]
        t = trajs[key]
        if status == END:
            t.finish()
        else:
            t.add_inserted(v[j + 3 : j + 3 + n])
            if status == GO:
                going.append(t)
        j += 3 + n
    return going, bool(v[0])
