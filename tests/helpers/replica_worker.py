"""One replica training a small float64 model with AdamW through ``elastic.replicated_step``:
every step is the mean over a global batch of B samples, whichever replicas share it. A lost
member makes the survivors recover and redo the step; a replica started with ``join`` heals the
model, the optimizer state and the step counter from a member (after ``OUT.go`` exists).

Args: ETCD JOB NAME (start N | join) STEPS OUT. Writes one JSON line per committed step (its
pid: this process, forked from the suite's preload server when one runs), ``"event"`` lines,
and at the end ``{"final": [...]}`` with every parameter flattened (float64, exact as
``float.hex``)."""

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher.preload import delegate

delegate(sets=QUIET_ENV)  # forked past torch's import when the suite's preload server runs

import json
import os
import random
import signal
import sys
import time

import torch

from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.elastic.arrivals import Arrivals
from spmd_rl.elastic.replica_group import ReplicaGroup
from spmd_rl.elastic.replicated_step import committed_steps, materialize, state_tensors

B = 12
DATA = 64
PACE_S = 0.05
LEASE_S = 2.0
"""The membership lease: a stopped replica is dropped once it lapses; the collective timeout is
the default users get."""
SLOW = "REPLICA_SLOW"
"""``STEP:SECONDS``: this replica sleeps that long before its share of that step (once), as a
replica with a longer generation reaches the collective later."""
SKEW = "REPLICA_SKEW"
"""``SEED:P:SECONDS``: before each step's share, with probability P, sleep uniform(0, SECONDS)
(a seeded stream of this replica's own): replicas reach each collective at different times."""
STOP_INSIDE = "REPLICA_STOP_INSIDE"
"""``STEP``: this replica SIGSTOPs itself right after it arrived at that step's first collective,
so its peers, arrived too, wait inside the gloo collective (its lease lapses meanwhile)."""


def problem() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """The model, its optimizer and the data: the same on every replica (seeded)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    x = torch.randn(DATA, 4, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True))
    return model, torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01), x, y


def share_loss(model, x, y, step: int, rank: int, world: int, local: int = 0, local_world: int = 1) -> torch.Tensor:
    """Summed squared error of this replica's samples of the step's global batch (of every
    ``local_world``-th of them from the ``local``-th, a replica's rank's part)."""
    rows = [(step * B + i) % DATA for i in range(B) if i % world == rank][local::local_world]
    return ((model(x[rows]) - y[rows]) ** 2).sum()


def reference_final(steps: int) -> torch.Tensor:
    """The uninterrupted run: one replica holding the whole global batch at every step."""
    model, opt, x, y = problem()
    for s in range(steps):
        opt.zero_grad()
        share_loss(model, x, y, s, 0, 1).backward()
        for p in model.parameters():
            p.grad /= B
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    etcd, job, name, mode = sys.argv[1:5]
    steps, out = (int(sys.argv[6]), sys.argv[7]) if mode == "start" else (int(sys.argv[5]), sys.argv[6])
    model, opt, x, y = problem()
    group = ReplicaGroup(MetadataStore([etcd], job), name, lease_s=LEASE_S, join_window_s=0.5)
    step = torch.zeros(1, dtype=torch.float64)
    log = open(out, "a", buffering=1)
    if mode == "start":
        group.start(int(sys.argv[5]))
    else:
        materialize(model, opt)
        while not os.path.exists(out + ".go"):
            time.sleep(0.01)
        group.join(lambda: [step, *state_tensors(model, opt)])

    def event(kind: str) -> None:
        log.write(json.dumps({"event": kind, "gen": group.gen.number, "world": group.world, "t": time.time()}) + "\n")

    slow_step, slow_s = (float(v) for v in os.environ.get(SLOW, "-1:0").split(":"))
    seed, p_skew, skew_s = (float(v) for v in os.environ.get(SKEW, "0:0:0").split(":"))
    skew = random.Random(int(seed))
    stop_step, stopping = int(os.environ.get(STOP_INSIDE, "-1")), [False]
    meet = Arrivals.meet

    def meet_then_stop(arrivals: Arrivals) -> None:
        meet(arrivals)
        if stopping[0]:
            stopping[0] = False
            os.kill(os.getpid(), signal.SIGSTOP)

    Arrivals.meet = meet_then_stop

    def loss(s: int, r: int, w: int) -> torch.Tensor:
        nonlocal slow_step, stop_step
        if s == stop_step:
            stop_step, stopping[0] = -1, True
        if s == slow_step:
            slow_step = -1
            time.sleep(slow_s)
        if skew.random() < p_skew:
            time.sleep(skew.uniform(0, skew_s))
        return share_loss(model, x, y, s, r, w)

    for s in committed_steps(group, model, opt, loss, B, step, steps, event):
        row = {"step": s, "gen": group.gen.number, "world": group.world, "pid": os.getpid(), "t": time.time()}
        log.write(json.dumps(row) + "\n")
        time.sleep(PACE_S)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    log.write(json.dumps({"final": [v.hex() for v in flat]}) + "\n")
    group.close()


if __name__ == "__main__":
    main()
