"""The held-out scores (``trainer.eval_scores``) against their definitions, computed another way:
pass@k as the exact fraction of k-subsets holding a right answer (enumerated, or by
``math.comb`` in rationals), maj@n by hand, and the per-source split."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from spmd_rl.trainer.eval_scores import ks_of, majority_right, pass_at_k, set_scores


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (4, 1), (5, 2), (8, 3), (8, 8), (16, 0), (16, 5)])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_right_answer(n, c):
    answers = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), k))
        counted = sum(any(answers[i] for i in s) for s in subsets) / len(subsets)
        # the product form against enumeration: float64 round-off over <= 16 factors, < 1e-12
        assert pass_at_k(n, c, k) == pytest.approx(counted, abs=1e-12)


@pytest.mark.parametrize("n,c,k", [(200, 13, 1), (200, 13, 10), (200, 13, 100), (1024, 1, 512), (1000, 999, 2)])
def test_pass_at_k_matches_the_binomial_formula_in_rationals_where_binomials_overflow_floats(n, c, k):
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    # float64 product of <= 1024 factors each rounded once: relative error < 1024 * 2^-53 ~ 1e-13
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


def test_pass_at_one_is_the_fraction_right_and_bad_counts_are_refused():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8, abs=1e-15)  # 1 - (1 - 1/8)...: one rounding per factor
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def test_the_ks_double_up_to_n():
    assert ks_of(1) == [1] and ks_of(4) == [1, 2, 4] and ks_of(6) == [1, 2, 4, 6]


def test_the_majority_votes_on_extracted_answers():
    assert majority_right(["3", "4", "3", None], [True, False, True, False])
    assert not majority_right(["3", "4", "4"], [True, False, False])
    # a tie goes to the answer seen first; answers without one do not vote
    assert majority_right([None, None, "7", "8"], [False, False, True, False])
    assert not majority_right(["8", "7"], [False, True])
    assert not majority_right([None, None], [False, False])


def test_set_scores_split_by_source():
    sources = ["gsm8k", "math", "gsm8k"]
    greedy = np.array([1.0, 0.0, 0.0])
    sampled = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=np.float64)
    majority = np.array([0.0, 1.0, 0.0])
    out = set_scores("held", sources, greedy, sampled, majority)
    assert out["eval/held/greedy"] == pytest.approx(1 / 3, abs=1e-15)
    assert out["eval/held/gsm8k/greedy"] == 0.5 and out["eval/held/math/greedy"] == 0.0
    assert out["eval/held/mean@4"] == pytest.approx(5 / 12, abs=1e-15)
    assert out["eval/held/gsm8k/pass@4"] == 0.5 and out["eval/held/gsm8k/pass@1"] == pytest.approx(1 / 8)
    assert out["eval/held/pass@2"] == pytest.approx((0.5 + 1 + 0) / 3, abs=1e-15)  # 1 - C(3,2)/C(4,2) = 1/2
    assert out["eval/held/maj@4"] == pytest.approx(1 / 3) and out["eval/held/math/maj@4"] == 1.0
    assert out["eval/held/prompts"] == 3 and out["eval/held/math/prompts"] == 1
    # one source only: no per-source copies of the set's scores
    assert set(set_scores("s", ["a", "a"], np.ones(2), None, None)) == {"eval/s/greedy", "eval/s/prompts"}
