"""One rank of a two-rank replica (one torchrun per replica): the model of
``replica_worker.problem`` sharded with FSDP2 over the replica's ranks (gradients summed inside
it), each shard reduced with the same shard of the other replicas through ``ReplicaGroup``'s
column groups (HSDP) by ``committed_steps``. Each rank takes every other sample of its replica's
share. A replica started with ``join`` heals its shards from a member's (after ``OUT.go``).

Args: ETCD JOB NAME (start N | join) STEPS OUT. Local rank 0 writes one JSON line per step and,
at the end, ``{"final": [...]}`` with the full parameters (float64 as ``float.hex``)."""

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher.preload import delegate

delegate(sets=QUIET_ENV)  # forked past torch's import when the suite's preload server runs

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from spmd_rl.distributed.teardown import exit_after
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.elastic.replica_group import ReplicaGroup
from spmd_rl.elastic.replicated_step import committed_steps, materialize, state_tensors
from tests.helpers.replica_worker import B, LEASE_S, PACE_S, problem, share_loss


def main() -> None:
    etcd, job, name, mode = sys.argv[1:5]
    steps, out = (int(sys.argv[6]), sys.argv[7]) if mode == "start" else (int(sys.argv[5]), sys.argv[6])
    dist.init_process_group("gloo")
    local, local_world = dist.get_rank(), dist.get_world_size()
    model, _, x, y = problem()
    fully_shard(model, mesh=init_device_mesh("cpu", (local_world,)))
    model.set_gradient_divide_factor(1.0)  # the replica's sum, not its ranks' mean
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    group = ReplicaGroup(
        MetadataStore([etcd], job),
        name,
        lease_s=LEASE_S,
        join_window_s=0.5,
        local_pg=dist.group.WORLD,
    )
    step = torch.zeros(1, dtype=torch.float64)
    log = open(out, "a", buffering=1) if local == 0 else None
    if mode == "start":
        group.start(int(sys.argv[5]))
    else:
        materialize(model, opt)
        while not os.path.exists(out + ".go"):
            time.sleep(0.01)
        group.join(lambda: [step, *state_tensors(model, opt)])
    loss = lambda s, r, w: share_loss(model, x, y, s, r, w, local, local_world)  # noqa: E731
    for s in committed_steps(group, model, opt, loss, B, step, steps):
        if log:
            log.write(json.dumps({"step": s, "world": group.world, "pid": os.getpid(), "t": time.time()}) + "\n")
        time.sleep(PACE_S)
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]).tolist()
    if log:
        log.write(json.dumps({"final": [v.hex() for v in full]}) + "\n")
    group.close()


if __name__ == "__main__":
    exit_after(main)
