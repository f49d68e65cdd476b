"""The exactly-once check of the prompt ledger (``trainer.ledger.problems``) on hand-made
histories, the gathering of what the update read (``trainer.observed``), and the ledger's etcd
round trip with a restart that forgets redone iterations. The crash test that uses them is
test_exactly_once_torchrun; a real run with a desynchronised putter is in test_trainer_torchrun."""

from __future__ import annotations

from spmd_rl.dock.metadata import MetadataStore
import pytest

from spmd_rl.trainer.ledger import PromptLedger, StepRecord, problems
from spmd_rl.trainer.observed import trained_groups

GOOD = [
    StepRecord(0, [1, 2, 3, 4], [1, 2], [3, 4]),
    StepRecord(1, [5, 6], [3, 5], [4, 6]),
    StepRecord(2, [7, 8], [4, 6, 7], [], {"8": "dynamic sampling: constant reward in its group"}),
]


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


OBSERVED = StepRecord(0, [1, 2], [1, 2], put=[1, 2], trained_samples=4, group_size=2)


def test_observed_puts_and_reads_are_checked():
    assert problems([OBSERVED]) == []
    desync = StepRecord(0, [1, 2], [1, 9], put=[1, 9], trained_samples=4, group_size=2)  # a putter drew row 9
    found = problems([desync])
    assert any("sampled but never put [2]" in p for p in found) and any(
        "put [9], neither sampled nor carried" in p for p in found
    )
    not_put = StepRecord(0, [1, 2], [1, 2], put=[1, 2, 2], trained_samples=4, group_size=2)
    assert any("put twice" in p for p in problems([not_put]))
    stale = StepRecord(0, [1, 2], [1, 2], put=[1], trained_samples=4, group_size=2)
    assert any("trained [2], never put" in p for p in problems([stale]))
    read_twice = StepRecord(0, [1, 2], [1, 2], put=[1, 2], trained_samples=5, group_size=2)
    assert any("read 5 samples for 2 groups of 2" in p for p in problems([read_twice]))
    carried_in = StepRecord(1, [5], [3, 5], [], put=[3, 5], trained_samples=4, group_size=2)
    assert problems([carried_in], start_carried=[3]) == []  # a carried row is put again


@pytest.mark.usefixtures("world_of_one")
def test_trained_groups_reads_what_the_writers_report():
    """Groups of n = 2: a clean read, a sample read twice, and a group whose samples name two rows."""
    assert trained_groups([(0, 7), (1, 7), (4, 3), (5, 3)], 6, 2) == ([7, 3], 4)
    rows, read = trained_groups([(0, 7), (1, 7), (1, 7)], 6, 2)
    assert rows == [7] and read == 3  # problems: 3 samples for 1 group of 2
    assert trained_groups([(0, 7), (1, 8)], 6, 2) == ([7, 8], 2)  # an index mix-up: two rows in group 0


def test_ledger_round_trip_and_restart(etcd):
    ledger = PromptLedger(MetadataStore([etcd.endpoint], job="ledger-test.ledger"))
    ledger.restart_at(0)
    for rec in GOOD:
        ledger.record(rec)
    assert ledger.read() == GOOD
    ledger.restart_at(1)  # resumed from the checkpoint written after iteration 0
    assert ledger.read() == GOOD[:1]
