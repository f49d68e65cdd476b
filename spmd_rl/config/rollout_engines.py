"""``rollout.engine`` -> the rollout engine (verl's ``BaseRollout`` registry), declared once and
torch-free: each built-in engine's class as a ``module:Class`` the ranks import only when it is
chosen (so a run of one never imports the other), with what it can do as the entry's metadata.
``spmd-rl validate`` refuses a config that needs what its engine lacks, and the engine classes
(``engines.vllm.engine``, ``engines.hf.rollout``) carry these same objects as their
``capabilities``. A user's ``module:Class`` engine declares its own; the rank checks it when it
builds the engine (``engines.rollouts``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from spmd_rl.catalog import Registry


@dataclass(frozen=True)
class RolloutCapabilities:
    """What an engine can do. ``notes``: why a capability is missing, by name (the fix a refusal
    prints)."""

    adapters: bool = False
    """Serves LoRA adapters over frozen base weights (``actor.lora.sync: adapter``)."""
    routes: bool = False
    """Records the MoE experts of every token (``actor.moe.router_replay``)."""
    own_process: bool = False
    """Serves separated placement (a generation rank outside the training world)."""
    tensor_parallel: bool = False
    """Shards one model over several ranks (``parallel.gen.tp`` > 1)."""
    releases_memory: bool = False
    """``sleep`` frees device memory (weights and KV cache)."""
    settings: str | None = None
    """The section of ``rollout`` with the settings only this engine reads (``rollout.vllm``)."""
    notes: dict[str, str] = field(default_factory=dict)


ROLLOUTS: Registry = Registry("rollout engine", "; or a user's module:Class (docs/extending.md)")
"""name -> the engine's ``Rollout`` class; ``ROLLOUTS.meta[name]``: its ``RolloutCapabilities``."""
ROLLOUTS.declare(
    "vllm",
    "spmd_rl.engines.vllm.engine:VllmRollout",
    RolloutCapabilities(
        adapters=True, routes=True, own_process=True, tensor_parallel=True, releases_memory=True, settings="vllm"
    ),
)
ROLLOUTS.declare(
    "hf",
    "spmd_rl.engines.hf.rollout:HfRollout",
    RolloutCapabilities(
        own_process=True,
        releases_memory=True,
        notes={
            "adapters": "LoRA adapters are served by vLLM only; set actor.lora.sync=merge",
            "routes": "MoE routes are recorded by vLLM only; set actor.moe.router_replay=none",
            "tensor_parallel": "one model per generation rank; set parallel.gen.tp=1 (gen.dp replicates it)",
        },
    ),
)


def missing(caps: RolloutCapabilities, needs: dict[str, bool]) -> list[tuple[str, str]]:
    """(capability, the engine's note) for each of ``needs`` (capability -> asked for) that
    ``caps`` lacks."""
    return [
        (name, caps.notes.get(name, "not supported"))
        for name, want in needs.items()
        if want and not getattr(caps, name)
    ]
