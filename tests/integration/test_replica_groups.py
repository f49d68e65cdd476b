"""Replicas that keep training when one is SIGKILLed, and grow back when a new one joins
(``spmd_rl.elastic``: membership through a real etcd, torchft's reconfigurable gloo group), in
real processes (``tests/helpers/replica_worker.py``):

- the survivors keep their processes (the same pids before and after), agree on a generation
  without the dead one and redo the interrupted step;
- every step is committed exactly once on each survivor, none skipped, none twice;
- no step is taken on a partial gradient: each step's gradient is the batch mean whatever the
  split (integers, float64), so the final state equals the closed form on every replica;
- a replica started later heals from a survivor over the new group (no checkpoint) and its
  state at its first step is bit-identical to the survivors' at that step;
- a replica that stops answering (SIGSTOP) drops out once the collective timeout passes; when it
  runs again (SIGCONT) it finds itself left out, joins again and heals, in the same process.
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

STEPS = 160


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps(path) -> list[dict]:
    return [r for r in _rows(path) if "step" in r]


def _replica(etcd, tmp_path, name: str, *mode: str) -> subprocess.Popen:
    args = [etcd.endpoint, "replicas", name, *mode, str(STEPS), str(tmp_path / f"{name}.jsonl")]
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests/helpers/replica_worker.py"), *args],
        cwd=REPO,
        env=subprocess_env(),
        stdout=open(tmp_path / f"{name}.log", "w"),
        stderr=subprocess.STDOUT,
    )


def _lose_join_stop_resume(procs: dict, tmp_path) -> float:
    """c SIGKILLed at step 20; d joins once a and b step without it; b SIGSTOPped 10 steps after
    d's first, and SIGCONTed once a and d step without it. Returns the time of the SIGKILL."""
    rows = {n: (lambda n=n: _steps(tmp_path / f"{n}.jsonl")) for n in "abcd"}
    wait_for(lambda: all(len(rows[n]()) >= 20 for n in "abc"), 120, "three replicas at step 20")
    procs["c"].send_signal(signal.SIGKILL)
    killed = time.time()
    wait_for(lambda: all(any(r["world"] == 2 for r in rows[n]()) for n in "ab"), 60, "two survivors stepping")
    (tmp_path / "d.jsonl.go").touch()
    wait_for(lambda: len(rows["d"]()) >= 10, 60, "the joiner stepping")
    procs["b"].send_signal(signal.SIGSTOP)
    stopped = time.time()
    wait_for(lambda: any(r["world"] == 2 and r["t"] > stopped for r in rows["d"]()), 60, "a and d stepping")
    procs["b"].send_signal(signal.SIGCONT)
    return killed


@pytest.mark.slow
def test_survivors_keep_their_processes_redo_the_step_and_heal_a_joiner(etcd, tmp_path, record_property):
    procs = {n: _replica(etcd, tmp_path, n, "start", "3") for n in "abc"} | {"d": _replica(etcd, tmp_path, "d", "join")}
    try:
        killed = _lose_join_stop_resume(procs, tmp_path)
        for n in "abd":
            assert procs[n].wait(timeout=120) == 0, (tmp_path / f"{n}.log").read_text()[-3000:]
    finally:
        for p in procs.values():
            p.kill()
    a, b, d = (_steps(tmp_path / f"{n}.jsonl") for n in "abd")
    expected = [float(sum(s * B + (B - 1) / 2 for s in range(STEPS)))] * 4
    assert [r["step"] for r in a] == list(range(STEPS))  # each step once, in order, none skipped
    for name, rows in (("a", a), ("b", b), ("d", d)):
        assert {r["pid"] for r in rows} == {procs[name].pid}, name  # the same process throughout
        assert rows[-1]["state"] == expected, name  # no step on a partial gradient
        steps = [r["step"] for r in rows]
        assert steps == sorted(set(steps)) and steps[-1] == STEPS - 1, name
    assert any(r["world"] == 2 and r["t"] > killed for r in a) and a[-1]["world"] == 3
    # d joined, b rejoined after its stop: each healed to the survivors' state, bit for bit
    first = d[0]["step"]
    assert first > 0 and [r["step"] for r in d] == list(range(first, STEPS)) and d[0]["state"] == a[first]["state"]
    gap = next(k for k in range(1, len(b)) if b[k]["step"] != b[k - 1]["step"] + 1)
    assert b[gap]["state"] == a[b[gap]["step"]]["state"] and b[gap]["world"] == 3
    events = [r["event"] for r in _rows(tmp_path / "b.jsonl") if "event" in r]
    assert "lost" in events and events[-1] == "recovered", events
    record_property("seconds_from_sigkill_to_next_step", round([r["t"] for r in a if r["world"] == 2][0] - killed, 2))
