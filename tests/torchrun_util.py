"""Launch a script on simulated nodes: one torchrun agent per node on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from spmd_rl.dock.etcd_server import free_port
from tests.conftest import REPO, TEST_OWNER, subprocess_env
from tests.preload_servers import COPY_MARK


def run_nodes(
    script: Path, nnodes: int, nproc_per_node: int, env: dict[str, str], log_dir: Path, timeout_s: float = 180
) -> list[str]:
    """Start ``nnodes`` torchrun agents (static rendezvous, distinct --node-rank), wait for all,
    and return their logs; raise with the logs if any agent failed. The master port is picked
    before node 0 binds it: when another process took it in between, launch again on a new one."""
    for attempt in range(3):
        codes, texts = _launch(script, nnodes, nproc_per_node, env, log_dir, timeout_s, free_port())
        if not any(codes):
            return texts
        if not any("EADDRINUSE" in t or "address already in use" in t for t in texts):
            break
    raise AssertionError(f"agents exited {codes}:\n" + "\n".join(t[-4000:] for t in texts))


def _launch(
    script: Path, nnodes: int, nproc_per_node: int, env: dict[str, str], log_dir: Path, timeout_s: float, port: int
) -> tuple[list[int], list[str]]:
    full_env = subprocess_env() | env
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    procs, logs = [], []
    for node in range(nnodes):
        log = open(log_dir / f"agent{node}.log", "w")
        cmd = torchrun + [
            f"--nnodes={nnodes}",
            f"--node-rank={node}",
            f"--nproc-per-node={nproc_per_node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(script),
        ]
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
    return codes, [(log_dir / f"agent{n}.log").read_text() for n in range(nnodes)]


QUIET_CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below ``pid`` (torchrun starts its workers in new
    sessions, so killing the agent's process group does not reach them)."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    children: dict[int, list[tuple[int, str]]] = {}
    for line in out:
        p, pp, args = line.split(None, 2)
        children.setdefault(int(pp), []).append((int(p), args))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def workers_of(pid: int) -> list[int]:
    """Worker processes (python -m spmd_rl.train) below the launcher ``pid``: direct children
    of a torchrun agent. A worker's own short-lived children (fork before exec) carry its
    command line too; killing one of those would leave the run untouched."""
    agents = {p for p, args in descendants(pid) if "torch.distributed.run" in args}
    return [p for p, args in _children_of(agents) if "spmd_rl.train" in args and "torch.distributed.run" not in args]


def _children_of(parents: set[int]) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    rows = [line.split(None, 2) for line in out]
    return [(int(p), args) for p, pp, args in rows if int(pp) in parents]


def kill_tree(proc: subprocess.Popen, also: list[tuple[int, str]] = ()) -> None:
    """Never leave a launcher or its workers behind: SIGKILL every process below ``proc`` (and
    ``also``, a tree seen earlier, whose parent may be gone by now), then it."""
    for pid, _ in [*also, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()


def node_agent(
    tmp: Path, etcd: str, name: str, args: list[str], extra_env: dict[str, str] | None = None
) -> subprocess.Popen:
    """One simulated node: ``launch/multi_node.sh`` (torchrun, etcd-v2 rendezvous, 1 worker)
    in its own session, logging to ``tmp/<name>.log``."""
    env = (
        subprocess_env()
        | {"ETCD": etcd, "NNODES": "1:2", "NPROC": "1", "TOKEN": "elastic-token-0123456789abcdef", "RESTARTS": "8"}
        | (extra_env or {})
    )
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen(
        [str(REPO / "launch/multi_node.sh"), *args],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def kill_node(agent_proc: subprocess.Popen) -> None:
    """SIGKILL a whole simulated node: the agent and every process below it."""
    tree = descendants(agent_proc.pid)
    os.kill(agent_proc.pid, signal.SIGKILL)
    for pid, _ in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent_proc.wait()


def metric_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_for(cond, timeout: float, what: str) -> float:
    """Seconds until ``cond()`` holds; AssertionError after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def live_with_environ(entry: str, skip: set[int] = frozenset()) -> list[str]:
    """``pid command`` of every live (not zombie) process but ``skip`` whose ``/proc/<pid>/environ``
    holds ``entry`` (``NAME=value``): the environment it was executed with."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) in skip:
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if entry.encode() in env and stat[stat.rindex(")") + 2] != "Z":
            out.append(f"{pid} {cmd[:80]}")
    return out


def preloaded_copies() -> list[str]:
    """Live processes forked from this pytest process's preload servers (ranks and what they
    forked), as ``pid command``: none may outlive the job that started them. They carry
    ``COPY_MARK`` in ``/proc/<pid>/environ`` instead of their job's variables."""
    from tests.conftest import _PRELOAD

    return live_with_environ(f"{COPY_MARK}={os.getpid()}", skip=_PRELOAD.pids)


def mapped_shm_names() -> set[str]:
    """The /dev/shm names some live process maps (its own and other jobs' segments in use)."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        out |= {
            line.rsplit("/dev/shm/", 1)[1] for line in lines if "/dev/shm/" in line and not line.endswith(" (deleted)")
        }
    return out


class OwnShm:
    """The /dev/shm names that processes this test session started map (they carry
    ``TEST_OWNER`` in their environment, ``conftest.subprocess_env``), sampled every
    ``period_s`` while the block runs. ``leaked()``: those still in /dev/shm that no live
    process maps, i.e. shared memory whose creator died before it could unlink it. Another
    job's segments on the host are never looked at."""

    def __init__(self, period_s: float = 0.5):
        self.seen: set[str] = set()
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="own-shm", daemon=True)

    def __enter__(self) -> "OwnShm":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        mark = f"{TEST_OWNER}={os.getpid()}".encode()
        while not self._stop.wait(self.period_s):
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if mark not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                        continue
                    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
                except OSError:
                    continue
                self.seen |= {
                    line.rsplit("/dev/shm/", 1)[1]
                    for line in lines
                    if "/dev/shm/" in line and not line.endswith(" (deleted)")
                }

    def leaked(self) -> set[str]:
        return {n for n in self.seen if os.path.exists(f"/dev/shm/{n}")} - mapped_shm_names()

    def named_cpushm(self) -> set[str]:
        """vLLM CPU TP segments this session's processes mapped that still have a name in
        /dev/shm (engines.vllm.shm unlinks each once every rank mapped it). Only this
        session's: another pytest worker's job may hold its own for a while."""
        return {n for n in self.seen if "cpushm" in n and os.path.exists(f"/dev/shm/{n}")}
