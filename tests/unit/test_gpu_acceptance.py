"""The acceptance run's schedule (``tools/gpu_acceptance.py``, issue 70 finding 3), rehearsed on
CPU with the same steps, each a sleep of its estimated seconds, and the budget scaled the same:
the steps run most valuable first, the whole run stays within its budget, a step the budget no
longer fits is skipped, and each step's line is written the moment it ends."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.conftest import REPO

SCALE = 0.02
BUDGET = 720 * SCALE
ORDER = ["install", "doctor", "weights", "smoke", "run", "trl", "update", "attention"]


def _rows(out):
    return [line.split("\t") for line in (out / "status.tsv").read_text().splitlines()]


def test_the_rehearsed_run_fits_its_budget_in_order_of_value(tmp_path):
    done = subprocess.run(
        [sys.executable, "tools/gpu_acceptance.py", "bundle", str(tmp_path), "--rehearse", str(SCALE)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = _rows(tmp_path)
    assert [r[0] for r in rows] == ORDER, done.stdout  # every step accounted for, in order
    assert sum(float(r[2]) for r in rows) <= BUDGET + 0.5, rows  # the steps' own seconds stay in the budget
    assert all(r[1] == "0" for r in rows[:4]), rows  # install, doctor, weights and the smoke run fit
    assert any(r[1] == "skip" for r in rows), rows  # the caps add up to 2,040 s: the tail cannot all fit
    assert all(float(r[2]) <= float(r[3]) + 0.5 for r in rows if r[1] != "skip"), rows  # no step past its limit
    assert done.returncode == 1  # not every step passed


def test_a_run_cut_off_midway_has_written_each_step_that_ended(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "tools/gpu_acceptance.py", "bundle", str(tmp_path), "--rehearse", str(SCALE)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    time.sleep(4.0)  # install (1.8 s) and doctor (0.3 s) have ended; weights (1.2 s), then smoke runs 4.8 s
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    rows = _rows(tmp_path)
    assert [r[0] for r in rows][:2] == ["install", "doctor"] and all(r[1] == "0" for r in rows), rows
