"""How long survivors take to step again after a replica is lost (``spmd_rl.elastic``): three
replicas (``tests/helpers/replica_worker.py``: a small model, AdamW, ``replicated_step``)
against one embedded etcd; one is SIGKILLed (its sockets close) or SIGSTOPped (it stops
answering, its sockets stay open) mid-run, or stops itself right after it arrived at a step's
gradient sum (``REPLICA_STOP_INSIDE``: a and b wait inside the gloo collective), or is
SIGKILLed while survivor b is 6 s late to the next step (the survivors notice the loss at
different times); the time is from the signal (the stop, seen in ``/proc``) to
the survivors' first committed step in the generation without it, and the generations they
formed (1: b, late, was not dropped as well). Median of ``--runs`` per kind; printed against
the membership lease, the bound a stopped node cannot beat (its peers wait for it while its
lease holds). The processes are never restarted.
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


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def one_loss(endpoint: str, tmp: Path, job: str, sig: int | None, late_s: float = 0.0) -> tuple[float, int]:
    """(seconds from ``sig`` to the survivors' first step without the lost replica, the
    generations the survivors formed). ``late_s``: survivor b reaches the step after the loss
    that much later than a (``REPLICA_SLOW``), so the two notice the loss at different times.
    ``sig`` None: c stops itself inside step ``at``'s first collective."""
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    at = 20 if not late_s else 24

    def env_of(n: str) -> dict:
        if n == "b" and late_s:
            return env | {"REPLICA_SLOW": f"{at}:{late_s}"}
        return env | ({"REPLICA_STOP_INSIDE": str(at)} if n == "c" and sig is None else {})

    procs = {
        n: subprocess.Popen(
            [sys.executable, str(REPO / "tests/helpers/replica_worker.py"), endpoint, job, n, "start", "3", "100000"]
            + [str(tmp / f"{job}-{n}.jsonl")],
            env=env_of(n),
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / f"{job}-{n}.log", "w"),
        )
        for n in "abc"
    }
    try:
        if sig is None:
            while not stopped(procs["c"].pid):
                time.sleep(0.005)
        else:
            while not all(len(steps(tmp / f"{job}-{n}.jsonl")) >= at for n in "abc"):
                time.sleep(0.05)
            procs["c"].send_signal(sig)
        t0 = time.time()
        while not all(any(r["world"] == 2 for r in steps(tmp / f"{job}-{n}.jsonl")) for n in "ab"):
            time.sleep(0.02)
        time.sleep(1.0)  # a few more steps: a survivor dropped for being late would show a later generation
        survivors = [steps(tmp / f"{job}-{n}.jsonl") for n in "ab"]
        first = max(min(r["t"] for r in rows if r["world"] == 2) for rows in survivors)
        return first - t0, max(r["gen"] for rows in survivors for r in rows)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", help="run only the kinds whose name contains this")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-replica-loss-"))
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "")
    kinds = (
        ("SIGKILL", signal.SIGKILL, 0.0),
        ("SIGSTOP", signal.SIGSTOP, 0.0),
        ("SIGSTOP in collective", None, 0.0),
        ("SIGKILL, b 6 s late", signal.SIGKILL, 6.0),
    )
    with EmbeddedEtcd() as etcd:
        rows = {
            name: [one_loss(etcd.endpoint, tmp, f"k{i}r{k}", sig, late) for k in range(args.runs)]
            for i, (name, sig, late) in enumerate(kinds)
            if not args.only or args.only in name
        }
    print(
        f"# {cpu or platform.machine()}, {os.cpu_count()} CPUs; 3 replicas, lease {LEASE_S:g} s; median of {args.runs}"
    )
    print(f"{'lost by':20} {'to next step s':>15} {'/ lease':>8} {'generations':>12}  runs")
    for name, got in rows.items():
        med = statistics.median(v for v, _ in got)
        gens = max(g for _, g in got)
        print(f"{name:20} {med:15.2f} {med / LEASE_S:8.2f} {gens:12d}  {' '.join(f'{v:.2f}' for v, _ in got)}")


if __name__ == "__main__":
    main()
