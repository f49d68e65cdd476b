"""``actor.backend`` -> ``TrainBackend``: what the package knows about a training backend, in
one object (torchtitan's ``ModelSpec``, verl's engine registry): the engine class the ranks
build for the actor and its reference (``engine``, a ``module:Class`` imported only by the
ranks), the builders of the other trained roles it offers (``roles``), its per-rank memory
model (``memory``, for ``plan`` and the residency estimates), and its refusals (``rules``, for
``validate``). ``trainer/build.py``, ``recipe/estimates.py``, ``recipe/plan.py`` and the rules
read the object, never the backend's name. Adding a backend is one engine folder and one
entry here.

The engine class offers ``from_config(cfg, acc, mesh, policy, *, trainable=True,
total_steps=None)``; a role builder is ``fn(cfg, acc, mesh, total_steps) -> Engine``: one
signature each for every backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spmd_rl.catalog import Registry
from spmd_rl.recipe.backend_rules import fsdp_rules, megatron_rules
from spmd_rl.config.errors import Violation
from spmd_rl.recipe.estimates import (
    DTYPE_BYTES,
    RankMemory,
    fsdp_memory,
    megatron_local_numel,
    megatron_memory,
    sharded_numel,
)
from spmd_rl.config.layout import Layout, Layouts
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.config.schema import Config
from spmd_rl.recipe.graph import stages_for


@dataclass(frozen=True)
class TrainBackend:
    name: str
    engine: str
    """``module:Class`` of the actor's (and reference's) engine, with ``from_config``."""
    memory: Callable[[Config, ModelArch, Layouts], RankMemory]
    """Per-rank bytes of the training state and the generation engine."""
    reference_numel: Callable[[Config, ModelArch, Layouts], int]
    """Elements a frozen reference holds per rank (0: it is the actor with adapters off)."""
    keeps_grads: bool
    """Gradients stay allocated between steps (megatron's float32 buffer), not only in a backward."""
    rules: Callable[[Config, ModelArch | None, Layout], list[Violation]]
    describe: Callable[[Layouts], str]
    """The training layout as ``plan`` prints it."""
    state: str
    """How the training state is held, as ``plan`` prints it."""
    preference_pairs: bool
    """Trains DPO's pairs (``algorithm.name: dpo``)."""
    elastic_replicas: bool
    """Its gradients can be summed across elastic replicas (``Engine.gradient_sync``)."""
    roles: dict[str, str]
    """The trained roles it builds beyond the actor and the reference: role -> ``module:function``
    (``critic``: PPO's value model, ``reward_model``: a score model). A run that needs one it
    lacks is refused by ``validate`` (``check_backend``)."""


def _fsdp_reference(cfg: Config, arch: ModelArch, lay: Layouts) -> int:
    """The actor's sharded elements; none with LoRA (the actor with its adapters off)."""
    return 0 if cfg.actor.lora is not None else sharded_numel(arch.tensors(), lay)


TRAIN_BACKENDS: Registry[TrainBackend] = Registry("training backend")
for backend in (
    TrainBackend(
        "fsdp",
        "spmd_rl.engines.fsdp.engine:TrainEngine",
        fsdp_memory,
        _fsdp_reference,
        keeps_grads=False,
        rules=fsdp_rules,
        describe=lambda lay: f"dp_shard={lay.train.dp} tp={lay.train.tp}",
        state="AdamW",
        preference_pairs=True,
        elastic_replicas=True,
        roles={
            "critic": "spmd_rl.engines.fsdp.heads:critic",
            "reward_model": "spmd_rl.engines.fsdp.heads:reward_model",
        },
    ),
    TrainBackend(
        "megatron",
        "spmd_rl.engines.megatron.engine:MegatronEngine",
        megatron_memory,
        lambda cfg, arch, lay: megatron_local_numel(arch, lay.train.tp, lay.train.pp, cfg.parallel.train.ep),
        keeps_grads=True,
        rules=megatron_rules,
        describe=lambda lay: f"megatron-core dp={lay.train.dp} pp={lay.train.pp} tp={lay.train.tp}",
        state="AdamW, megatron distributed optimizer: float32 grad buffer, moments over dp",
        preference_pairs=False,
        elastic_replicas=False,
        roles={},
    ),
):
    TRAIN_BACKENDS[backend.name] = backend


def train_backend(cfg: Config) -> TrainBackend:
    return TRAIN_BACKENDS.lookup(cfg.actor.backend)


ROLE_NEEDS = {
    "critic": ("algorithm.name", "a critic (a value model)", "an algorithm without a critic (grpo, dapo)"),
    "reward_model": ("reward.kind", "a reward model (a score model)", "reward.kind: rule"),
}
"""role -> (the field that asks for it, what it is, the way out without it)."""


def check_backend(cfg: Config) -> list[Violation]:
    """``actor.backend`` names a registered backend (the schema takes any name: this table is
    the one list of them)."""
    if cfg.actor.backend in TRAIN_BACKENDS:
        return []
    names = ", ".join(sorted(TRAIN_BACKENDS))
    return [Violation("actor.backend", cfg.actor.backend, "not a registered training backend", f"use one of {names}")]


def check_roles(cfg: Config) -> list[Violation]:
    """The backend builds every trained role the stage graph uses beyond the actor and the
    reference (``TrainBackend.roles``)."""
    needed = {r for s in stages_for(cfg) for r in s.roles}
    backend, out = train_backend(cfg), []
    for role in sorted(needed & ROLE_NEEDS.keys() - backend.roles.keys()):
        field, what, instead = ROLE_NEEDS[role]
        builders = sorted(n for n in TRAIN_BACKENDS if role in TRAIN_BACKENDS.lookup(n).roles)
        out.append(
            Violation(
                "actor.backend",
                backend.name,
                f"{field} needs {what}, which the {backend.name} backend does not build",
                f"use {instead}, or actor.backend: {' or '.join(builders) or '(none builds it)'}",
            )
        )
    return out


def rank_memory(cfg: Config, arch: ModelArch, lay: Layouts) -> RankMemory:
    """Per-rank bytes under the run's backend (``TrainBackend.memory``)."""
    return train_backend(cfg).memory(cfg, arch, lay)


def role_bytes(
    cfg: Config,
    arch: ModelArch,
    lay: Layouts,
    critic_arch: ModelArch | None = None,
    reward_arch: ModelArch | None = None,
) -> dict[str, int]:
    """Per-rank bytes each role holds while resident, at a stage's entry: trainable roles their
    params and two AdamW states in ``actor.param_dtype`` (gradients exist only inside a backward
    pass and are freed after the step, unless the backend ``keeps_grads``), frozen roles
    (reference, reward model) their params in the compute dtype ``model.dtype`` (no master
    copy); the rollout engine its weights and KV cache. The critic and the reward model are
    their trunk plus a one-output head (``hidden`` weights, + 1 bias for the critic's
    token-classification head)."""
    backend = train_backend(cfg)
    pb, cb = DTYPE_BYTES[cfg.actor.param_dtype], DTYPE_BYTES[cfg.model.dtype]
    mem = backend.memory(cfg, arch, lay)
    out = {
        "actor": mem.train_params + mem.train_optim + (mem.train_grads if backend.keeps_grads else 0),
        "ref": backend.reference_numel(cfg, arch, lay) * cb,
        "rollout": mem.gen_weights + mem.kv_cache,
    }
    for role, a, head in (("critic", critic_arch, 1), ("reward_model", reward_arch, 0)):
        if a is not None:
            trunk = [t for t in a.tensors() if t.name != "lm_head.weight"]
            numel = sharded_numel(trunk, lay) + -(-a.hidden_size // lay.train.dp) + head
            out[role] = numel * pb * 3 if role == "critic" else numel * cb
    return out
