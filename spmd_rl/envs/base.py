"""The environment interface of multi-turn rollouts, in the project's own words.

An environment is made once per trajectory by its factory from a dataset row, then receives each
of the policy's turns, as the sampled text and its token ids, and answers with a ``Step``: an
observation to insert (text the rollout renders once as a tool turn with the chat template's
own pieces, or token ids inserted as they are), a reward contribution, whether the trajectory
is done, and metadata for the metrics. Environments are registered by name
(``register_environment``) or loaded from a user's ``module:function`` factory taking the row
(``envs.factory``).

Invariant the rollout keeps, not the environment: the trainer only ever sees tokens that were
sampled or inserted; the environment never re-tokenizes what the policy wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from spmd_rl.catalog import Registry


@dataclass(frozen=True)
class Turn:
    """The policy's last turn: its text and the token ids that were sampled."""

    text: str
    token_ids: tuple[int, ...]


@dataclass
class Step:
    observation: str | list[int] | None = None
    """Text for a tool turn, token ids to insert as they are, or None (nothing to insert)."""
    reward: float = 0.0
    done: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    """Counted by the rollout's metrics: ``tool_calls``, ``tool_errors``, ``tool_timeouts``."""


class Environment(Protocol):
    def step(self, turn: Turn) -> Step: ...


EnvironmentFactory = Callable[[dict], Environment]
"""A dataset row (its prompt and answer columns) -> a fresh environment for one trajectory."""

ENVIRONMENTS: Registry[EnvironmentFactory] = Registry("environment", "; or give a user's factory as module:function")
register_environment = ENVIRONMENTS.register
