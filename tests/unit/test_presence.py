"""The presence board (``dock.presence``): a slot never written is infinitely old, a beat from
another process is seen by the lead, and an open refuses a file that is not the board."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from spmd_rl.dock.node_lease import NodeLease
from spmd_rl.dock.presence import PresenceBoard, PresenceUnavailable
from tests.conftest import REPO


def test_a_slot_is_infinitely_old_until_its_rank_beats():
    board = PresenceBoard.create(3)
    try:
        assert board.ages() == [float("inf")] * 3
        board.beat(1, now=100.0)
        ages = board.ages(now=102.5)
        assert ages[1] == pytest.approx(2.5) and ages[0] == ages[2] == float("inf")
    finally:
        board.close()


def test_another_process_beats_on_the_leads_board_through_proc():
    board = PresenceBoard.create(2)
    code = (
        "import json, sys; from spmd_rl.dock.presence import PresenceBoard; "
        "b = PresenceBoard.open(json.loads(sys.argv[1])); b.beat(1, now=7.0); b.close()"
    )
    try:
        subprocess.run([sys.executable, "-c", code, json.dumps(board.ref())], check=True, cwd=REPO, timeout=60)
        assert board.ages(now=10.0) == [float("inf"), pytest.approx(3.0)]
    finally:
        board.close()


def test_an_open_refuses_a_file_that_is_not_the_board(tmp_path):
    board = PresenceBoard.create(2)
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
    os.ftruncate(other, 64)
    try:
        ref = board.ref()
        with pytest.raises(PresenceUnavailable, match="not the node's presence board"):
            PresenceBoard.open(ref | {"fd": other})  # a reused fd number: another inode
        with pytest.raises(PresenceUnavailable, match="not the node's presence board"):
            PresenceBoard.open(ref | {"slots": 64})  # shorter than the slots it must hold
        with pytest.raises(PresenceUnavailable, match="cannot open"):
            PresenceBoard.open(ref | {"fd": 987654})  # nothing there
        opened = PresenceBoard.open(ref)
        opened.close()
    finally:
        os.close(other)
        board.close()


def test_the_lead_counts_silence_only_while_it_watched_itself():
    """A whole process frozen (its lead and its beating ranks alike) must not make the lead
    withdraw its ranks on waking: silence counts from the end of the lead's own last gap. A
    lead that took the board's age alone withdrew every rank of a node that had been frozen."""
    lead = NodeLease(None, 0, [0, 1, 2], ttl_s=3)
    try:
        now = time.monotonic()
        lead.board.beat(1, now=now - 10.0)
        lead._watching_since, lead._last_look = now - 30.0, now - 0.5  # watching all along
        assert lead.silent_for()[1] == pytest.approx(10.0, abs=0.5)
        assert lead.silent_for()[2] == float("inf")  # never beat: not started, never withdrawn
        lead._last_look = time.monotonic() - 10.0  # the lead itself was frozen for 10 s
        assert lead.silent_for()[1] < 0.5
        time.sleep(0.3)
        assert 0.2 < lead.silent_for()[1] < 1.0  # counted from the wake
    finally:
        lead.board.close()
