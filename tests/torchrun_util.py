"""Launch a script on simulated nodes: one torchrun agent per node on loopback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from spmd_rl.dock.etcd_server import free_port
from tests.conftest import REPO, subprocess_env


def run_nodes(script: Path, nnodes: int, nproc_per_node: int, env: dict[str, str], log_dir: Path, timeout_s: float = 180) -> list[str]:
    """Start ``nnodes`` torchrun agents (static rendezvous, distinct --node-rank), wait for all,
    and return their logs; raise with the logs if any agent failed."""
    port = free_port()
    full_env = subprocess_env() | env
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    procs, logs = [], []
    for node in range(nnodes):
        log = open(log_dir / f"agent{node}.log", "w")
        cmd = torchrun + [f"--nnodes={nnodes}", f"--node-rank={node}", f"--nproc-per-node={nproc_per_node}",
                          "--master-addr=127.0.0.1", f"--master-port={port}", str(script)]
        procs.append(subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        logs.append(log)
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=timeout_s))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    texts = [(log_dir / f"agent{n}.log").read_text() for n in range(nnodes)]
    if any(codes):
        raise AssertionError(f"agents exited {codes}:\n" + "\n".join(t[-4000:] for t in texts))
    return texts


QUIET_CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
