"""The presence board (``dock.presence``): a slot never written is infinitely old, a beat from
another process is seen by the lead, and an open refuses, before opening it, any file that is
not a memfd named for this job (another job's board, a pipe, a regular file a process holds),
and after opening it one whose inode or size is not the record's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from spmd_rl.dock.node_lease import NodeLease
from spmd_rl.dock.presence import PresenceBoard, PresenceUnavailable, presence_name
from tests.conftest import REPO

NAME = presence_name(b"a job key")


def test_a_slot_is_infinitely_old_until_its_rank_beats():
    board = PresenceBoard.create(3, NAME)
    try:
        assert board.ages() == [float("inf")] * 3
        board.beat(1, now=100.0)
        ages = board.ages(now=102.5)
        # exact in float64: 102.5 - 100.0; approx's default
        assert ages[1] == pytest.approx(2.5) and ages[0] == ages[2] == float("inf")
    finally:
        board.close()


def test_another_process_beats_on_the_leads_board_through_proc():
    board = PresenceBoard.create(2, NAME)
    code = (
        "import json, sys; from spmd_rl.dock.presence import PresenceBoard; "
        "b = PresenceBoard.open(json.loads(sys.argv[1]), sys.argv[2]); b.beat(1, now=7.0); b.close()"
    )
    try:
        subprocess.run([sys.executable, "-c", code, json.dumps(board.ref()), NAME], check=True, cwd=REPO, timeout=60)
        # exact in float64: 10.0 - 7.0; approx's default
        assert board.ages(now=10.0) == [float("inf"), pytest.approx(3.0)]
    finally:
        board.close()


def test_an_open_refuses_a_file_that_is_not_the_board(tmp_path):
    board = PresenceBoard.create(2, NAME)
    other_job = PresenceBoard.create(2, presence_name(b"another job key"))
    held = os.open(tmp_path / "held", os.O_RDWR | os.O_CREAT)
    os.ftruncate(held, 64)
    fifo_r, fifo_w = os.pipe()
    ref = board.ref()
    try:
        for fd in (other_job.fd, held, fifo_r):  # by name, before any open: a pipe's would block
            with pytest.raises(PresenceUnavailable, match="not this job's presence board"):
                PresenceBoard.open(ref | {"fd": fd}, NAME)
        with pytest.raises(PresenceUnavailable, match="not the node's presence board"):
            PresenceBoard.open(ref | {"ino": ref["ino"] + 1}, NAME)  # a reused fd number: another inode
        with pytest.raises(PresenceUnavailable, match="not the node's presence board"):
            PresenceBoard.open(ref | {"slots": 64}, NAME)  # shorter than the slots it must hold
        with pytest.raises(PresenceUnavailable, match="cannot open"):
            PresenceBoard.open(ref | {"fd": 987654}, NAME)  # nothing there
        with pytest.raises(PresenceUnavailable, match="lacks"):
            PresenceBoard.open({"pid": "x"}, NAME)
        with open(tmp_path / "held", "rb") as f:
            assert f.read() == bytes(64)  # nothing was written where the record pointed
        PresenceBoard.open(ref, NAME).close()
    finally:
        for fd in (held, fifo_r, fifo_w):
            os.close(fd)
        other_job.close()
        board.close()


def test_the_lead_counts_silence_only_while_it_watched_itself():
    """A whole process frozen (its lead and its beating ranks alike) must not make the lead
    withdraw its ranks on waking: silence counts from the end of the lead's own last gap. A
    lead that took the board's age alone withdrew every rank of a node that had been frozen."""
    lead = NodeLease(None, 0, [0, 1, 2], ttl_s=3, board_name=NAME)
    try:
        now = time.monotonic()
        lead.board.beat(1, now=now - 10.0)
        lead._watching_since, lead._last_look = now - 30.0, now - 0.5  # watching all along
        # wall clock, not round-off: silent_for reads time.monotonic() again; 0.5 s of scheduling slack
        assert lead.silent_for()[1] == pytest.approx(10.0, abs=0.5)
        assert lead.silent_for()[2] == float("inf")  # never beat: not started, never withdrawn
        lead._last_look = time.monotonic() - 10.0  # the lead itself was frozen for 10 s
        assert lead.silent_for()[1] < 0.5
        time.sleep(0.3)
        assert 0.2 < lead.silent_for()[1] < 1.0  # counted from the wake
    finally:
        lead.board.close()


class _LapsedLeaseStore:
    """A metadata store whose node record names a real board but whose lease is always gone."""

    def __init__(self, board: PresenceBoard):
        self.record = json.dumps({"lease": 1, "board": board.ref()}).encode()

    def key(self, *parts) -> str:
        return "/" + "/".join(map(str, parts))

    def wait_for(self, key: str, timeout_s: float) -> bytes:
        return self.record

    def put(self, *args, **kwargs) -> None:
        from spmd_rl.dock.metadata import LeaseGone

        raise LeaseGone("lease not found")


def test_a_rank_beat_that_fails_to_start_or_stops_early_leaves_no_descriptor_open():
    """A start that times out after opening the lead's board (its lease never renewed), and a
    stop before its beat thread ran, close the board: no fd is left per attempt (before, each
    failed start kept one open)."""
    from spmd_rl.dock.errors import DockTimeout
    from spmd_rl.dock.node_lease import RankBeat

    def boards_open() -> int:  # descriptors of this process on the board (other tests' fds come and go)
        out = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                out += os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:{NAME} (deleted)"
            except OSError:
                pass
        return out

    board = PresenceBoard.create(2, NAME)
    try:
        assert boards_open() == 1
        for _ in range(3):
            beat = RankBeat(_LapsedLeaseStore(board), 0, 1, 1, ttl_s=3, wait_s=0.3, board_name=NAME)
            with pytest.raises(DockTimeout):
                beat.start()
            beat.stop()
        assert boards_open() == 1
    finally:
        board.close()
