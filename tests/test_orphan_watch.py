"""engines.orphan_watch with real processes: a SIGKILLed "rank" takes the children it handed
to its watcher (and their descendants) with it; a pid whose start time does not match (a
reused pid) is left alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, subprocess_env
from tests.torchrun_util import wait_for

RANK = """
import subprocess, sys, time
from spmd_rl.engines.orphan_watch import OrphanWatch, children
before = children()
engine = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', "
                          "'import time; time.sleep(600)']); print(w.pid, flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
worker = int(engine.stdout.readline())
watch = OrphanWatch()
watch.watch(children() - before - {watch.proc.pid})
print(engine.pid, worker, watch.proc.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2] != "Z"


def test_a_killed_rank_takes_its_engine_and_the_engines_children_with_it():
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True, cwd=REPO, env=subprocess_env())
    try:
        engine, worker, watcher = map(int, rank.stdout.readline().split())
        assert alive(engine) and alive(worker) and alive(watcher)
        rank.kill()
        rank.wait()
        wait_for(lambda: not (alive(engine) or alive(worker) or alive(watcher)), 15, "the dead rank's engine, its worker and the watcher to exit")
    finally:
        rank.kill()


def test_a_pid_with_another_start_time_is_not_killed():
    from spmd_rl.engines.orphan_watch import OrphanWatch, start_time

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
