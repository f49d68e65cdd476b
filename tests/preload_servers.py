"""The suite's preload servers (spmd_rl/launcher/preload.py): every rank the tests start
(``python -m spmd_rl.train`` and the tests/helpers workers under torchrun) forks from one past
its imports instead of importing (about 10 CPU-s of each rank's start), unless its environment
differs from the one the servers started with; then it imports by itself, as without them."""

from __future__ import annotations

import os
from collections import Counter
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher import preload

"""What a rank imports before its own code runs."""
PER_TEST_VARIABLES = [
    "PYTEST_CURRENT_TEST",
    "MODEL",
    "CKPT",
    "DTYPE",
    "TP",
    "SP",
    "PP",
    "EP",
    "TRAIN_TP",
    "TRAIN_DP",
    "GEN_TP",
    "DOCK_MODE",
    "MODE",
    "WRITERS",
    "ROUTES",
    "RLEN",
    "RELAY_MIN",
    "N",
    "G",
    "LORA_SYNC",
    "ETCD",
    "ETCD_CA",
    "ETCD_CERT",
    "ETCD_KEY",
    "INTERFACE",
    "JOB",
    "NNODES",
    "NPROC",
    "RESTARTS",
    "TOKEN",
    "LAST_CALL_S",
    "RDZV_TIMEOUT_S",
    "KEEP_ALIVE_S",
    "CONFIG",
    "WANDB_SILENT",
    "BENCH_INTERFACE",
    "REPLICA_SLOW",
    "REPLICA_SKEW",
    "REPLICA_STOP_INSIDE",
]
"""Variables a test sets per run (pytest's own, the tests/helpers workers' parameters,
``launch/multi_node.sh``'s, which a simulated node's agent passes on to its ranks; wandb's): a
rank may differ in them from the servers unless an import looked one up (``preload --free``).
What in-process vLLM sets in the test process its subprocesses do not inherit
(``conftest.LIBRARY_SET``)."""
COPY_MARK = "SPMD_RL_TEST_PRELOADED"
"""In the servers' environment as ``COPY_MARK=<pytest's pid>``: a forked rank's
``/proc/<pid>/environ`` is the server's (the kernel shows the environment a process was
executed with), so the rank, and what it forks (vLLM's engine core), carry this mark and not
its job's variables; ``torchrun_util.preloaded_copies`` finds them by it."""
SERVERS = 2
"""One per local rank of the suite's 2-rank jobs: the ranks of a job differ in their string-hash
seeds as fresh interpreters do (``preload.ENV``)."""


class PreloadServers:
    """The servers of one pytest process. ``SPMD_RL_TEST_PRELOAD=0`` runs the suite without."""

    def __init__(self):
        self.sockets: list[str] = []
        self.procs: list[subprocess.Popen] = []

    @property
    def pids(self) -> set[int]:
        return {p.pid for p in self.procs}

    @property
    def env_value(self) -> str:
        return os.pathsep.join(self.sockets)

    def start(self, env: dict[str, str], cwd: Path) -> None:
        """Start the servers with ``env``, the environment every rank of the session gets."""
        if os.environ.get("SPMD_RL_TEST_PRELOAD", "1") == "0":
            return
        folder = tempfile.mkdtemp(prefix="spmd-rl-preload-")  # 0700: only this user reaches the sockets
        env = {k: v for k, v in env.items() if k != preload.ENV} | QUIET_ENV  # what a rank sets before it imports vLLM
        env[COPY_MARK] = str(os.getpid())
        for k in range(SERVERS):
            path = os.path.join(folder, f"preload{k}.sock")
            with open(path + ".log", "w") as log:
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-u",
                            "-m",
                            "spmd_rl.launcher.preload",
                            path,
                            *preload.LIBRARIES,
                            *(f"--free={name}" for name in PER_TEST_VARIABLES),
                        ],
                        env=env,
                        cwd=cwd,
                        stdin=subprocess.PIPE,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
            self.sockets.append(path)
        deadline = time.monotonic() + 60
        for path, proc in zip(self.sockets, self.procs):  # bound before they import: ranks connecting now wait
            while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)

    def forks(self, program: str) -> int:
        """How many copies the servers have forked so far of a program whose argv begins with
        ``program`` (the logged ``argv[0] argv[1]``, e.g. ``.../spmd_rl/cli.py eval``)."""
        return sum(
            line.split(": ", 1)[-1].startswith(program)
            for path in self.sockets
            for line in Path(path + ".log").read_text().splitlines()
            if line.startswith("forked")
        )

    def stop(self) -> str:
        """Stop the servers; one line: how many ranks they forked, which refusals they made."""
        if not self.procs:
            return ""
        lines: list[str] = []
        for path, proc in zip(self.sockets, self.procs):
            proc.stdin.close()  # EOF: a server kills what it still runs and exits
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            lines += Path(path + ".log").read_text().splitlines()
        shutil.rmtree(os.path.dirname(self.sockets[0]), ignore_errors=True)
        self.sockets, self.procs = [], []
        refused = Counter(line.split(" | ")[0] for line in lines if line.startswith("refused"))
        where = {
            reason: sorted(
                {
                    line.split("; ", 1)[-1].split(" ")[0]
                    for line in lines
                    if line.startswith(reason + " | ") and "; " in line
                }
            )[:3]
            for reason in refused
        }
        return f"{sum(line.startswith('forked') for line in lines)} ranks forked" + "".join(
            f"; {n} {r}" + (f" (in {', '.join(where[r])})" if where[r] else "") for r, n in sorted(refused.items())
        )
