"""One replica of a data-parallel job that survives its peers' loss (``spmd_rl.elastic``).

Each step trains on a global batch of B samples whose gradients are integers (sample i of step
s: ``s * B + i``, the same on every replica), split over the generation's members by ``i % world
== rank``: the summed all-reduce divided by B is the batch mean whatever the split, exactly (in
float64), so the state after the last step is the same for any history of losses and joins
(split invariance, as the objective's). A step is taken only when ``should_commit`` says every
member got through it; a failed collective makes every survivor agree on the next generation
and redo the step. A replica started with ``join`` heals from the first member (state and step
counter) at the members' next step boundary, once the file OUT.go exists.

Args: ETCD JOB NAME (start N | join) STEPS OUT. Writes one JSON line per committed step (and
``"event"`` lines) to OUT."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.elastic.replica_group import ReplicaGroup, ReplicaLost

B = 12
LEASE_S = 2.0
PACE_S = 0.05


def share_of_gradient(step: int, rank: int, world: int) -> torch.Tensor:
    """Sum of the gradients of this replica's samples of the step (4 equal coordinates)."""
    return torch.full((4,), float(sum(step * B + i for i in range(B) if i % world == rank)), dtype=torch.float64)


def main() -> None:
    etcd, job, name, mode = sys.argv[1:5]
    steps, out = (int(sys.argv[6]), sys.argv[7]) if mode == "start" else (int(sys.argv[5]), sys.argv[6])
    group = ReplicaGroup(MetadataStore([etcd], job), name, lease_s=LEASE_S, join_window_s=0.5, timeout_s=LEASE_S)
    state, step = torch.zeros(4, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    log = open(out, "a", buffering=1)

    def event(kind: str) -> None:
        log.write(json.dumps({"event": kind, "gen": group.gen.number, "world": group.world, "t": time.time()}) + "\n")

    if mode == "start":
        group.start(int(sys.argv[5]))
    else:
        while not os.path.exists(out + ".go"):  # started ahead, past its imports: joins when told
            time.sleep(0.01)
        group.join([state, step])
        event("healed")
    while int(step.item()) < steps:
        try:
            if group.joiners_waiting():
                group.recover([state, step])
                event("grew")
                continue  # every member, the joiner too, is at the step boundary again
            s = int(step.item())
            total = group.allreduce(share_of_gradient(s, group.rank, group.world))
            if not group.should_commit(True):
                raise ReplicaLost("a member did not get through the step")
        except ReplicaLost:
            event("lost")
            group.recover([state, step])
            event("recovered")
            continue
        state += total / B
        step += 1
        row = {"step": s, "gen": group.gen.number, "world": group.world, "rank": group.rank, "pid": os.getpid()}
        log.write(json.dumps(row | {"t": time.time(), "state": state.tolist()}) + "\n")
        time.sleep(PACE_S)
    group.close()


if __name__ == "__main__":
    main()
