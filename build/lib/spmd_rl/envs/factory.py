"""Environment lookup: a built-in by name, or a user's ``module:function`` factory."""

from __future__ import annotations

from spmd_rl.envs import calculator, python_tool  # noqa: F401  (the built-ins register themselves)
from spmd_rl.envs.base import ENVIRONMENTS, EnvironmentFactory


def environment_factory(name: str, unsafe_python_without_jail: bool = False) -> EnvironmentFactory:
    """A registered environment, or ``module:function`` (a factory taking the dataset row). The
    ``python`` environment runs its code in a jail unless ``unsafe_python_without_jail``
    (``rollout.unsafe_python_without_jail``)."""
    if name == "python":
        return python_tool.factory(jail=not unsafe_python_without_jail)
    return ENVIRONMENTS.lookup(name)
