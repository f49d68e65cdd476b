"""Token-budget micro-batches (``trainer/stages/micro.py``): the runs cover the rows in order,
respect both bounds, are the fewest for the order, and every rank ends with the same count."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from spmd_rl.config.loader import load_config
from spmd_rl.recipe.rules import check
from spmd_rl.trainer.stages.micro import micro_plan, run_cost, split_to, token_runs
from tests.conftest import REPO
from tests.torchrun_util import run_nodes


def _covers(runs: list[slice], n: int) -> bool:
    return [k for r in runs for k in range(r.start, r.stop)] == list(range(n)) and all(r.stop > r.start for r in runs)


def _fewest(lengths: list[int], max_samples: int, budget: int, packed: bool) -> int:
    """Brute force over every way to cut the order into runs."""
    n, best = len(lengths), len(lengths)
    for cuts in itertools.product((0, 1), repeat=n - 1):
        bounds = [0] + [k + 1 for k, c in enumerate(cuts) if c] + [n]
        runs = [lengths[a:b] for a, b in zip(bounds, bounds[1:])]
        if all(len(r) <= max_samples and (len(r) == 1 or run_cost(r, packed) <= budget) for r in runs):
            best = min(best, len(runs))
    return best


@pytest.mark.parametrize("packed", [True, False])
def test_runs_cover_the_rows_within_both_bounds_and_are_the_fewest(packed):
    rnd = random.Random(0)
    for _ in range(200):
        lengths = sorted((rnd.randint(1, 40) for _ in range(rnd.randint(1, 9))), reverse=True)
        max_samples, budget = rnd.randint(1, 6), rnd.randint(20, 120)
        runs = token_runs(lengths, max_samples, budget, packed)
        assert _covers(runs, len(lengths))
        for r in runs:
            assert r.stop - r.start <= max_samples
            assert r.stop - r.start == 1 or run_cost(lengths[r], packed) <= budget
        assert len(runs) == _fewest(lengths, max_samples, budget, packed)


def test_cost_is_what_the_forward_computes():
    assert run_cost([7, 5, 2], packed=True) == 14  # packed: the tokens themselves
    assert run_cost([7, 5, 2], packed=False) == 21  # padded to the longest
    # so the same budget makes more micro-batches padded than packed
    assert token_runs([9, 3, 3, 3], 4, 18, packed=True) == [slice(0, 4)]
    assert token_runs([9, 3, 3, 3], 4, 18, packed=False) == [slice(0, 2), slice(2, 4)]
    assert token_runs([9, 3, 3, 3], 4, None, packed=True) == [slice(0, 4)]  # no budget: micro_batch_size only
    assert token_runs([9, 3, 3, 3], 3, None, packed=True) == [slice(0, 3), slice(3, 4)]


def test_a_sample_over_the_budget_runs_alone_and_split_to_reaches_any_count():
    assert token_runs([50, 10, 10], 8, 30, packed=True) == [slice(0, 1), slice(1, 3)]
    lengths = [12, 11, 9, 9, 4, 3, 2, 1]
    runs = token_runs(lengths, 8, 40, packed=True)
    for count in range(len(runs), len(lengths) + 1):
        got = split_to(runs, lengths, count, packed=True)
        assert len(got) == count and _covers(got, len(lengths))
    assert split_to([slice(0, 2), slice(2, 8)], lengths, 3, packed=True) == [
        slice(0, 2),
        slice(2, 5),
        slice(5, 8),
    ]  # the costliest halves
    with pytest.raises(ValueError, match="8 samples cannot make 9"):
        split_to(runs, lengths, 9, packed=True)


@pytest.mark.slow
def test_ranks_with_different_lengths_run_the_same_number_of_micro_batches(tmp_path):
    """Two gloo ranks plan three mini-batches whose greedy counts differ per rank (one collective)."""
    run_nodes(
        REPO / "tests/helpers/micro_plan_worker.py",
        nnodes=1,
        nproc_per_node=2,
        env={"SPMD_RL_OUT": str(tmp_path)},
        log_dir=tmp_path,
    )
    plans = [json.loads((tmp_path / f"plan{r}.json").read_text()) for r in range(2)]
    greedy = [p["greedy"] for p in plans]
    assert greedy[0] != greedy[1]  # the case the collective is for
    counts = [[len(m) for m in p["plan"]] for p in plans]
    assert counts[0] == counts[1] == [max(a, b) for a, b in zip(*greedy)]
    for p in plans:
        start = 0
        for mini, (a, b) in zip(p["plan"], p["minis"]):
            assert [k for s, e in mini for k in range(s, e)] == list(range(a, b))
            start = b
        assert start == len(p["lengths"])


def test_a_budget_below_one_full_sample_is_refused():
    cfg = load_config(REPO / "configs/quickstart.yaml", ["actor.micro_batch_tokens=39"])  # PL 32 + SL 8
    bad = [v for v in check(cfg)[1] if v.field == "actor.micro_batch_tokens"]
    assert bad and "use at least 40" in bad[0].fix
    ok = load_config(REPO / "configs/quickstart.yaml", ["actor.micro_batch_tokens=40"])
    assert not [v for v in check(ok)[1] if v.field == "actor.micro_batch_tokens"]


def test_without_a_budget_the_plan_is_fixed_size_and_needs_no_collective():
    cfg = load_config(REPO / "configs/quickstart.yaml", [])
    lengths = torch.tensor([9, 8, 7, 6, 5, 4, 3])
    assert micro_plan(cfg, lengths, [slice(0, 4), slice(4, 7)], 3) == [[slice(0, 3), slice(3, 4)], [slice(4, 7)]]
