"""Cross-field validation: every rule that relates fields to each other, to the world size, to
the model's config.json or to files on disk. ``check`` returns all violations at once and
loads no weights and starts no process group. The rules live next to what they check
(``batch_rules``, ``model_rules``, ``algorithm_rules``, ``runtime_rules``, ``stream_rules``,
``backend_rules`` and each backend's entry, ``env_rules``, ``dpo_rules``, ``replica_rules``);
this module runs them in order.
"""

from __future__ import annotations

from spmd_rl.recipe.backend_rules import check_gen_experts, check_router_replay
from spmd_rl.recipe.dpo_rules import check_dpo
from spmd_rl.recipe.env_rules import check_environment
from spmd_rl.recipe.replica_rules import check_replicas
from spmd_rl.config.errors import Violation
from spmd_rl.config.layout import Layouts, resolve_layouts
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.config.schema import Config
from spmd_rl.recipe.stream_rules import check_partial, check_separated
from spmd_rl.recipe.train_backends import check_backend, check_roles, train_backend
from spmd_rl.recipe.batch_rules import check_batches
from spmd_rl.recipe.model_rules import check_files, check_model, check_reward
from spmd_rl.recipe.algorithm_rules import check_algorithm
from spmd_rl.recipe.runtime_rules import (
    check_records_groups,
    check_relay,
    check_rollout_engine,
    check_runtime,
    check_tls,
)


def check(cfg: Config, world: int | None = None, nproc_per_node: int | None = None) -> tuple[Layouts, list[Violation]]:
    """All cross-field violations of ``cfg`` for the given world size (default: the config's)."""
    lay, out = resolve_layouts(cfg, world, nproc_per_node)
    if bad := check_backend(cfg):  # every rule below reads the backend's entry
        return lay, out + bad
    if not out:
        out += check_batches(cfg, lay)
    out += check_roles(cfg)
    out += check_model(cfg, lay)
    out += check_files(cfg)
    out += check_reward(cfg)
    out += check_algorithm(cfg)
    out += check_runtime(cfg)
    out += check_relay(cfg, lay)
    out += check_records_groups(cfg)
    out += check_tls(cfg)
    out += check_rollout_engine(cfg, lay)
    out += check_partial(cfg)
    out += check_separated(cfg)
    arch = _arch(cfg)
    out += train_backend(cfg).rules(cfg, arch, lay.train)
    out += check_router_replay(cfg, arch)
    out += check_gen_experts(cfg, arch, lay.gen)
    out += check_environment(cfg, lay.gen)
    out += check_dpo(cfg)
    out += check_replicas(cfg, lay)
    return lay, out


def _arch(cfg: Config) -> ModelArch | None:
    """The model's architecture, None when ``check_model`` already reports it unreadable."""
    try:
        return ModelArch.from_folder(cfg.model.path)
    except (OSError, KeyError, ValueError):
        return None
