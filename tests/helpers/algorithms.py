"""A user's algorithm (``algorithm.name: tests.helpers.algorithms:MEDIAN``), defined the way a
user defines one in their own module, with no edit to the package: a spec naming its estimator
as ``module:function``."""

from __future__ import annotations

from spmd_rl.algos.specs import AlgorithmSpec


def median_baseline(rewards, group_size: int, norm_by_std: bool):
    """A_i = r_i - the median reward of its prompt's group (``torch.median``: the lower of the
    two middle values for an even N)."""
    r = rewards.reshape(-1, group_size)
    return (r - r.median(dim=1, keepdim=True).values).reshape(-1)


MEDIAN = AlgorithmSpec(
    "tests.helpers.algorithms:MEDIAN", "sequence", "tests.helpers.algorithms:median_baseline", group_relative=True
)
