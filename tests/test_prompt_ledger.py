"""The exactly-once check of the prompt ledger (``trainer.ledger.problems``) on hand-made
histories, and the ledger's etcd round trip with a restart that forgets redone iterations.
The crash test that uses both is in test_partial_rollout."""

from __future__ import annotations

from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.trainer.ledger import PromptLedger, StepRecord, problems

GOOD = [StepRecord(0, [1, 2, 3, 4], [1, 2], [3, 4]), StepRecord(1, [5, 6], [3, 5], [4, 6]),
        StepRecord(2, [7, 8], [4, 6, 7], [], {"8": "dynamic sampling: constant reward in its group"})]


def test_a_consistent_history_has_no_problem():
    assert problems(GOOD) == []
    assert problems(GOOD[1:], start_carried=[3, 4]) == []


def test_each_violation_is_named():
    twice = GOOD[:2] + [StepRecord(2, [7, 8], [4, 6, 7, 8, 1], [])]
    assert any("trained a prompt twice ([1])" in p for p in problems(twice))
    lost = GOOD[:1] + [StepRecord(1, [5, 6], [3, 5], [6])]
    assert any("lost [4]" in p for p in problems(lost))
    resampled = GOOD[:1] + [StepRecord(1, [2, 6], [3, 2], [4, 6])]
    assert any("already handed out" in p for p in problems(resampled))
    gap = [GOOD[0], GOOD[2]]
    assert any("not contiguous" in p for p in problems(gap))
    both = [StepRecord(0, [1, 2], [1, 2], [2])]
    assert problems(both)  # trained and carried at once


def test_ledger_round_trip_and_restart(etcd):
    ledger = PromptLedger(MetadataStore([etcd.endpoint], job="ledger-test.ledger"))
    ledger.restart_at(0)
    for rec in GOOD:
        ledger.record(rec)
    assert ledger.read() == GOOD
    ledger.restart_at(1)  # resumed from the checkpoint written after iteration 0
    assert ledger.read() == GOOD[:1]
