"""Build the rollout engine ``rollout.engine`` names (``config.rollout_engines.ROLLOUTS``, whose
entries import their engine's package only when chosen). A name with a colon is a user's
``module:Class`` (a ``Rollout`` subclass built from a ``RolloutBuild``), used with no edit to the
package.

A build that asks for what the engine does not declare (``Rollout.capabilities``) is refused
here, naming the field that asked and the engine's reason."""

from __future__ import annotations

from spmd_rl.config.rollout_engines import ROLLOUTS, missing
from spmd_rl.engines.base import Rollout, RolloutBuild


def rollout_class(name: str) -> type[Rollout]:
    """The class ``rollout.engine`` names: a registered engine's, or a user's ``module:Class``."""
    cls = ROLLOUTS.lookup(name)
    if not (isinstance(cls, type) and issubclass(cls, Rollout)):
        raise ValueError(f"rollout.engine={name!r}: {cls!r} is not a subclass of spmd_rl.engines.base.Rollout")
    return cls


def missing_capabilities(engine: type[Rollout], build: RolloutBuild) -> list[tuple[str, str]]:
    """The capabilities ``build`` asks for that the engine lacks, each with the engine's reason."""
    asked = {
        "adapters": build.lora is not None,
        "routes": build.record_routes,
        "own_process": build.own_process,
        "tensor_parallel": build.tp > 1,
    }
    return missing(engine.capabilities, asked)


def build_rollout_engine(build: RolloutBuild) -> Rollout:
    """The engine ``build.cfg.engine`` names, built; ValueError naming ``rollout.engine`` before
    anything is built when it lacks a capability the build needs."""
    cls = rollout_class(build.cfg.engine)
    if lacking := missing_capabilities(cls, build):
        why = "; ".join(f"{name}: {note}" for name, note in lacking)
        raise ValueError(f"rollout.engine={build.cfg.engine!r} cannot serve this run: {why}")
    return cls(build)
