"""distributed.orphan_watch with real processes: a SIGKILLed "rank" takes the children it handed
to its watcher (and their descendants) with it, and the names of the shared memory they had
mapped; a pid whose start time does not match (a reused pid) is left alone."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

from spmd_rl.distributed.orphan_watch import POLL_S
from tests.conftest import REPO, subprocess_env
from tests.torchrun_util import wait_for

WORKER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)  # what shm_open does: a segment only its creator would unlink
os.ftruncate(fd, 1 << 20)
seg = mmap.mmap(fd, 1 << 20)
seg[:5] = b"hello"
tmp = sys.argv[1] + ".tmp"  # what sem_open does: map a temporary file, link it to the name, unlink the temporary
fd = os.open(tmp, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 32)
sem = mmap.mmap(fd, 32)
os.link(tmp, sys.argv[1] + ".sem")
os.unlink(tmp)
fd = os.open(sys.argv[1] + ".closed", os.O_CREAT | os.O_RDWR, 0o600)  # what vLLM's queue does: close, then unlink
os.ftruncate(fd, 1 << 16)
closed = mmap.mmap(fd, 1 << 16)
os.close(fd)
print(os.getpid(), flush=True)
sys.stdin.readline()
closed.close()  # unmapped, never unlinked: the kill comes first
print("closed", flush=True)
time.sleep(600)
"""
RANK = """
import subprocess, sys, time
from spmd_rl.distributed.orphan_watch import OrphanWatch, children
before = children()
ENGINE = ("import subprocess, sys, time; "
          "w = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], stdin=subprocess.PIPE, "
          "stdout=subprocess.PIPE, text=True); "
          "print(w.stdout.readline().strip(), flush=True); sys.stdin.readline(); w.stdin.write('close\\\\n'); "
          "w.stdin.flush(); print(w.stdout.readline().strip(), flush=True); time.sleep(600)")
PIPES = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
engine = subprocess.Popen([sys.executable, "-c", ENGINE, *sys.argv[1:]], **PIPES)
worker = int(engine.stdout.readline())
watch = OrphanWatch()
watch.watch(children() - before - {watch.proc.pid})
print(engine.pid, worker, watch.proc.pid, flush=True)
sys.stdin.readline()  # the test's go: the worker unmaps its third segment
engine.stdin.write("close\\n")
engine.stdin.flush()
print(engine.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def mapped_inodes(pid: int) -> set[int]:
    return {
        int(f[4])
        for f in (line.split(None, 5) for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
        if len(f) == 6
    }


def alive(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2] != "Z"


def test_a_killed_rank_takes_its_engine_and_the_engines_children_with_it():
    segment = Path(f"/dev/shm/spmd-rl-test-{uuid.uuid4().hex}")
    closed = Path(f"{segment}.closed")
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, WORKER, str(segment)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=subprocess_env(),
    )
    try:
        engine, worker, watcher = map(int, rank.stdout.readline().split())
        assert alive(engine) and alive(worker) and alive(watcher)
        assert segment.exists() and Path(f"{segment}.sem").exists()
        time.sleep(3 * POLL_S)  # the watcher has seen the third segment mapped ...
        rank.stdin.write("go\n")
        rank.stdin.flush()
        assert rank.stdout.readline().strip() == "closed"  # ... and now nothing maps it
        assert closed.exists() and closed.stat().st_ino not in mapped_inodes(worker)
        rank.kill()
        rank.wait()
        wait_for(
            lambda: not (alive(engine) or alive(worker) or alive(watcher)),
            15,
            "the dead rank's engine, its worker and the watcher to exit",
        )
        # the worker's segment and semaphore: their creator was killed before it could unlink them
        assert not segment.exists() and not Path(f"{segment}.sem").exists()
        assert not closed.exists()  # unmapped before the kill, seen while mapped
    finally:
        rank.kill()
        for path in (segment, Path(f"{segment}.sem"), closed):
            path.unlink(missing_ok=True)


def test_a_pid_with_another_start_time_is_not_killed():
    from spmd_rl.distributed.orphan_watch import OrphanWatch, start_time

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        watch = OrphanWatch()
        watch.proc.stdin.write(f"{sleeper.pid} {int(start_time(sleeper.pid)) + 1}\n")  # what a reused pid looks like
        watch.close()
        assert alive(sleeper.pid)
        watch = OrphanWatch()
        watch.watch({sleeper.pid})
        watch.close()
        assert sleeper.wait(timeout=10) == -9
    finally:
        sleeper.kill()
