"""Replicas that keep training when one is SIGKILLed, and grow back when a new one joins
(``spmd_rl.elastic``: membership through a real etcd, torchft's reconfigurable gloo group), in
real processes (``tests/helpers/replica_worker.py``):

- the survivors keep their processes (the same pids before and after), agree on a generation
  without the dead one and redo the interrupted step;
- every step is committed exactly once on each survivor, none skipped, none twice;
- no step is taken on a partial gradient: each step's gradient is the batch mean whatever the
  split (integers, float64), so the final state equals the closed form on every replica;
- a replica started later heals from a survivor over the new group (no checkpoint) and its
  state at its first step is bit-identical to the survivors' at that step.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, subprocess_env
from tests.helpers.replica_worker import B
from tests.torchrun_util import wait_for

STEPS = 120


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps(path) -> list[dict]:
    return [r for r in _rows(path) if "step" in r]


@pytest.mark.slow
def test_survivors_keep_their_processes_redo_the_step_and_heal_a_joiner(etcd, tmp_path, record_property):
    def replica(name: str, *mode: str) -> subprocess.Popen:
        args = [etcd.endpoint, "replicas", name, *mode, str(STEPS), str(tmp_path / f"{name}.jsonl")]
        log = open(tmp_path / f"{name}.log", "w")
        return subprocess.Popen(
            [sys.executable, str(REPO / "tests/helpers/replica_worker.py"), *args],
            cwd=REPO,
            env=subprocess_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    procs = {n: replica(n, "start", "3") for n in "abc"} | {"d": replica("d", "join")}
    try:
        wait_for(
            lambda: all(len(_steps(tmp_path / f"{n}.jsonl")) >= 20 for n in "abc"), 120, "three replicas at step 20"
        )
        procs["c"].send_signal(signal.SIGKILL)
        killed = time.time()
        survivors = [tmp_path / f"{n}.jsonl" for n in "ab"]
        wait_for(lambda: all(any(r["world"] == 2 for r in _steps(p)) for p in survivors), 60, "two survivors stepping")
        (tmp_path / "d.jsonl.go").touch()
        for n in "abd":
            assert procs[n].wait(timeout=120) == 0, (tmp_path / f"{n}.log").read_text()[-3000:]
    finally:
        for p in procs.values():
            p.kill()
    a, b, d = (_steps(tmp_path / f"{n}.jsonl") for n in "abd")
    expected = [float(sum(s * B + (B - 1) / 2 for s in range(STEPS)))] * 4
    for name, rows in (("a", a), ("b", b)):
        assert {r["pid"] for r in rows} == {procs[name].pid}, name  # the same process throughout
        assert [r["step"] for r in rows] == list(range(STEPS)), name  # each step once, in order
        worlds = [r["world"] for r in rows]
        assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [3, 2, 3], name
        assert rows[-1]["state"] == expected, name
    first = d[0]["step"]
    assert first > 0 and [r["step"] for r in d] == list(range(first, STEPS))
    assert d[0]["state"] == a[first]["state"]  # healed: the survivors' state, bit for bit
    assert d[-1]["state"] == expected
    events = [r for r in _rows(tmp_path / "a.jsonl") if "event" in r]
    assert [e["event"] for e in events] == ["lost", "recovered", "grew"], events
    assert [e["world"] for e in events] == [3, 2, 3]
    after_kill = [r["t"] for r in a if r["world"] == 2][0] - killed
    record_property("seconds_from_sigkill_to_next_step", round(after_kill, 2))
