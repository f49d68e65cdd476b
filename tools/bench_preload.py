"""What the preload server (``spmd_rl/launcher/preload.py``) saves per job: one-iteration
quickstart runs of ``spmd-rl train`` (2 ranks, vLLM in-process), alternately with every rank
importing for itself (the baseline) and with ranks forked from a server started once.

Wall is the job's; CPU is the job's process tree (``wait4`` of ``spmd-rl train``) plus, with
the server, what its forked ranks used (the server's reaped-children time, ``/proc`` fields
cutime and cstime). Median of ``--runs`` per variant; prints one table with ratios against the
baseline. Run from the repository root: ``python tools/bench_preload.py``."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher import preload


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def children_cpu_s(pid: int) -> float:
    """CPU seconds of the reaped children of ``pid`` (its forked ranks)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def job(tmp: Path, name: str, env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s of the process tree) of one one-iteration run."""
    out = tmp / name
    cmd = [
        sys.executable,
        "-m",
        "spmd_rl.cli",
        "train",
        "configs/quickstart.yaml",
        "trainer.iterations=1",
        f"checkpoint.dir={out}/ckpt",
        f"logging.dir={out}/logs",
        "data.global_batch_size=8",
        "rollout.n=4",
        "actor.mini_batch_size=8",
        "actor.micro_batch_size=8",
        f"metadata.job=bench-{name}",
        "dock.port=0",
        "logging.progress=false",
    ]
    t0 = time.perf_counter()
    with open(tmp / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{name} failed: see {tmp / name}.log")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-preload-"))
    os.chmod(tmp, 0o700)
    socket_path = str(tmp / "preload.sock")
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1"}
    env.pop("SPMD_RL_PRELOAD", None)
    t0 = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "spmd_rl.launcher.preload", socket_path, *preload.LIBRARIES],
        env=env | QUIET_ENV,
        stdin=subprocess.PIPE,
    )  # as a rank imports vLLM
    while "imported" not in (Path(socket_path + ".log").read_text() if Path(socket_path + ".log").exists() else ""):
        time.sleep(0.1)
    server_start = time.perf_counter() - t0
    rows: dict[str, list[tuple[float, float]]] = {"baseline": [], "preload": []}
    for k in range(args.runs):
        rows["baseline"].append(job(tmp, f"base{k}", env))
        before = children_cpu_s(server.pid)
        wall, cpu = job(tmp, f"pre{k}", env | {"SPMD_RL_PRELOAD": socket_path})
        rows["preload"].append((wall, cpu + children_cpu_s(server.pid) - before))
    server.stdin.close()
    server.wait()
    log = Path(socket_path + ".log").read_text()
    forked, refused = log.count("\nforked "), log.count("\nrefused")
    base_wall = statistics.median(w for w, _ in rows["baseline"])
    base_cpu = statistics.median(c for _, c in rows["baseline"])
    print(
        f"# {cpu_model()}, {os.cpu_count()} CPUs; median of {args.runs} one-iteration "
        f"quickstart jobs (2 ranks); server start {server_start:.1f} s, once; {forked} ranks forked, {refused} refused"
    )
    print(f"{'variant':10} {'wall s':>8} {'ratio':>6} {'CPU s':>8} {'ratio':>6}")
    for name, values in rows.items():
        wall = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        print(f"{name:10} {wall:8.2f} {wall / base_wall:6.2f} {cpu:8.2f} {cpu / base_cpu:6.2f}")


if __name__ == "__main__":
    main()
