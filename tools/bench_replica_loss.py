"""How long survivors take to step again after a replica is lost (``spmd_rl.elastic``): three
replicas (``tests/helpers/replica_worker.py``: a small model, AdamW, ``replicated_step``)
against one embedded etcd; one is SIGKILLed (its sockets close) or SIGSTOPped (it stops
answering, its sockets stay open) mid-run; the time is
from the signal to the survivors' first committed step in the generation without it. Median of
``--runs`` per kind; printed against the liveness lease, the bound a stopped node cannot beat
(its peers wait for the collective timeout, set to the lease). The processes are never restarted.
Run from the repository root: ``python tools/bench_replica_loss.py``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spmd_rl.dock.etcd_server import EmbeddedEtcd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.helpers.replica_worker import LEASE_S  # noqa: E402


def steps(path: Path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "step" in r]


def one_loss(endpoint: str, tmp: Path, job: str, sig: int) -> float:
    """Seconds from ``sig`` to the survivors' first step without the lost replica."""
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = {
        n: subprocess.Popen(
            [sys.executable, str(REPO / "tests/helpers/replica_worker.py"), endpoint, job, n, "start", "3", "100000"]
            + [str(tmp / f"{job}-{n}.jsonl")],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / f"{job}-{n}.log", "w"),
        )
        for n in "abc"
    }
    try:
        while not all(len(steps(tmp / f"{job}-{n}.jsonl")) >= 20 for n in "abc"):
            time.sleep(0.05)
        procs["c"].send_signal(sig)
        t0 = time.time()
        while not all(any(r["world"] == 2 for r in steps(tmp / f"{job}-{n}.jsonl")) for n in "ab"):
            time.sleep(0.02)
        return max(min(r["t"] for r in steps(tmp / f"{job}-{n}.jsonl") if r["world"] == 2) for n in "ab") - t0
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-replica-loss-"))
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "")
    with EmbeddedEtcd() as etcd:
        rows = {
            name: [one_loss(etcd.endpoint, tmp, f"{name}{k}", sig) for k in range(args.runs)]
            for name, sig in (("SIGKILL", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP))
        }
    print(
        f"# {cpu or platform.machine()}, {os.cpu_count()} CPUs; 3 replicas, lease {LEASE_S:g} s; median of {args.runs}"
    )
    print(f"{'lost by':8} {'to next step s':>15} {'/ lease':>8}  runs")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"{name:8} {med:15.2f} {med / LEASE_S:8.2f}  {' '.join(f'{v:.2f}' for v in values)}")


if __name__ == "__main__":
    main()
