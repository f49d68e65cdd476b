"""The held-out scores of one evaluated set (``trainer.evaluate``), from per-prompt counts.

For a prompt with n sampled answers of which c are right:

- ``mean@n`` = c / n, averaged over prompts;
- ``pass@k`` = 1 - C(n - c, k) / C(n, k), the unbiased estimator of the chance that at least
  one of k answers drawn without replacement from the n is right (Chen et al. 2021, "Evaluating
  Large Language Models Trained on Code", eq. 1), computed as the product
  1 - prod_{i = n - c + 1}^{n} (1 - k / i) in float64 so no binomial overflows; averaged over
  prompts, for k = 1, 2, 4, ... up to n (and n itself);
- ``maj@n``: the majority vote of the n extracted answers is right (``majority_right``);
- ``greedy``: the one greedy answer is right.

Each is reported for the whole set and for each ``data_source`` in it: ``<prefix>/<set>/<score>``
and ``<prefix>/<set>/<source>/<score>``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k) (module docstring); 1.0 when every k-subset holds a right answer."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def ks_of(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def majority_right(answers: Sequence[str | None], right: Sequence[bool]) -> bool:
    """Whether the most frequent extracted answer (ties: the one seen first; answers that hold
    none do not vote) is one of the right ones; False when no answer holds one."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    return any(r for a, r in zip(answers, right) if a == winner)


def set_scores(
    name: str,
    sources: Sequence[str],
    greedy: np.ndarray | None,
    sampled: np.ndarray | None,
    majority: np.ndarray | None,
    prefix: str = "eval",
) -> dict[str, float]:
    """The scores of one set (module docstring): ``greedy[p]`` 1 when prompt p's greedy answer
    was right, ``sampled[p, j]`` 1 when its j-th sampled answer was, ``majority[p]`` 1 when its
    vote was; ``sources[p]`` its data_source. None: not evaluated."""
    out: dict[str, float] = {}
    groups = {"": np.arange(len(sources))} | {
        s: np.flatnonzero(np.asarray(sources) == s) for s in sorted(set(sources)) if s
    }
    if len(groups) == 2:  # one named source: its scores are the set's
        groups = {"": groups[""]}
    for source, rows in groups.items():
        key = f"{prefix}/{name}/" + (f"{source}/" if source else "")
        if greedy is not None:
            out[key + "greedy"] = float(greedy[rows].mean())
        if sampled is not None:
            n = sampled.shape[1]
            right = sampled[rows].sum(axis=1).astype(int)
            out[key + f"mean@{n}"] = float(sampled[rows].mean())
            for k in ks_of(n):
                out[key + f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in right]))
            out[key + f"maj@{n}"] = float(majority[rows].mean())
        out[key + "prompts"] = float(len(rows))
    return out
