"""DAPO dynamic sampling (Yu et al. 2025, verl ``recipe/dapo``): keep only prompt groups whose
rewards are not all equal (std > 0), generating more rounds until G such groups exist.

Invariant: the update batch holds exactly the first ``target`` signal-carrying groups in
generation order (round, then prompt), so it is a deterministic function of the rewards; a
group with constant rewards never reaches the update (it would only dilute the token-mean).
If the rounds run out first, the batch is topped up with the latest constant groups (zero
advantage) so its size stays G, and the shortfall is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def signal_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B / group_size] bool: True for groups whose rewards are not all equal."""
    r = rewards.reshape(-1, group_size)
    return ~(r == r[:, :1]).all(dim=1)


@dataclass
class GroupSelection:
    """Accumulates rounds of generated groups (global group ids) until ``target`` carry signal."""

    target: int
    kept: list[int] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)
    rounds: int = 0

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.target

    def add_round(self, group_ids: list[int], rewards: torch.Tensor, group_size: int) -> None:
        """``rewards`` [len(group_ids) * group_size], group-major, of one generation round."""
        self.rounds += 1
        for gid, ok in zip(group_ids, signal_groups(rewards, group_size).tolist()):
            (self.kept if ok and not self.done else self.discarded).append(gid)

    def final(self) -> tuple[list[int], int]:
        """(the ``target`` group ids to train on in ascending order, how many of them are
        constant-reward fillers because the rounds ran out)."""
        short = max(0, self.target - len(self.kept))
        fill = self.discarded[len(self.discarded) - short :] if short else []
        return sorted(self.kept[: self.target] + fill), short
