"""Kill the processes an engine started when the rank that started them dies.

An engine in its own process (separated placement: vLLM's engine core, a child of the rank)
is not watched by anyone: its workers follow the engine core (vLLM's death pipe), but nothing
follows the rank. A SIGKILLed or OOM-killed rank left its engine core and worker running,
holding gigabytes of host (and on a GPU, device) memory next to the restarted rank's new
engine (found in CI: an orphaned ``VLLM::EngineCore`` after the exactly-once SIGKILL test).

``OrphanWatch`` starts a small watcher process in its own session. The rank holds the only
write end of a pipe to the watcher's stdin; when the rank exits, however it dies, the kernel
closes that end, the watcher reads EOF and SIGKILLs every process it was given together with
their descendants, then exits. A pid is identified with its start time (``/proc/<pid>/stat``
field 22), so a pid the kernel has reused is never hit.

A killed engine cannot unlink its shared memory: on CPU, vLLM's engine core runs a
multiprocessing executor whose message queues are ``/dev/shm/psm_*`` segments of 160 and 240
MiB (sparse until written) and whose locks are named semaphores (``sem.mp-*``); only their
creators' finalisers (or the rank's resource tracker, which torchrun kills with the rank's
process group) unlink them. So the watcher also unlinks every ``/dev/shm`` name whose inode
the processes it kills have mapped. It matches inodes, not names, because a semaphore's
creator maps the temporary file that ``sem_open`` then linked to the name. The segments are the
engine's own (nothing outside its process tree opens them), and the memory goes when the last
mapping does. The watcher notes the mapped inodes every ``POLL_S`` while the rank lives, not only
at its death: a segment can be unmapped and still named when the kill comes (vLLM's
``ShmRingBuffer.__del__`` closes before it unlinks; an engine core that exits without running it
leaves the unlink to the resource tracker, which the watcher kills with the rest). Found in CI:
one ``psm_*`` segment outlived a clean separated-placement run.

Invariant (tested with real processes): SIGKILL the rank and its watched children are gone
within seconds, and so are the names of the shared memory they had mapped; a clean exit of the
rank leaves nothing behind either.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

POLL_S = 1.0
"""Seconds between the watcher's notes of what the watched processes map."""

WATCHER = r"""
import os, select, signal, sys

POLL_S = float(sys.argv[1])

def stat(pid):
    try:
        raw = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), fields[19]  # ppid, start time

def shm_inodes(pid):  # by inode: a semaphore maps under the temporary name sem_open linked it from
    try:
        lines = open(f"/proc/{pid}/maps").read().splitlines()
    except OSError:
        return set()
    return {int(f[4]) for f in (line.split(None, 5) for line in lines) if len(f) == 6 and f[5].startswith("/dev/shm/")}

def tree(roots):  # the live ones among roots and all their descendants
    found = {pid for pid, start in roots if (stat(pid) or (0, None))[1] == start}
    while True:
        more = {int(p) for p in os.listdir("/proc") if p.isdigit() and (stat(int(p)) or (0, 0))[0] in found} - found
        if not more:
            return found
        found |= more

watched, inodes, pending = [], set(), b""
while True:  # until the rank's write end closes; every POLL_S, note what the tree maps
    if select.select([0], [], [], POLL_S)[0]:
        chunk = os.read(0, 4096)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        watched += [(int(pid), start.decode()) for pid, start in (line.split() for line in lines if line.strip())]
    if watched:
        inodes |= set().union(*map(shm_inodes, tree(watched)))
targets = tree(watched)
inodes |= set().union(*(shm_inodes(pid) for pid in targets))
for pid in targets:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
for name in os.listdir("/dev/shm") if inodes else []:  # their creators die before they could unlink them
    try:
        if os.stat(f"/dev/shm/{name}").st_ino in inodes:
            os.unlink(f"/dev/shm/{name}")
    except OSError:
        pass
"""


def start_time(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()[19]


def children(pid: int | None = None) -> set[int]:
    """Pids whose parent is ``pid`` (default: this process)."""
    me, out = pid or os.getpid(), set()
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                raw = Path(f"/proc/{p}/stat").read_text()
            except OSError:
                continue
            if int(raw[raw.rindex(")") + 2 :].split()[1]) == me:
                out.add(int(p))
    return out


class OrphanWatch:
    """A watcher of this rank's death: ``watch(children() - before)`` after starting an engine."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WATCHER, str(POLL_S)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )

    def watch(self, pids: set[int]) -> None:
        for pid in sorted(pids):
            start = start_time(pid)
            if start is not None:
                self.proc.stdin.write(f"{pid} {start}\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        """Kill the watched processes now (the same path as the rank's death) and reap the watcher."""
        self.proc.stdin.close()
        self.proc.wait()
