"""Fields renamed in 0.2, read under their old names until 0.3 with a message naming the new one.

A config file's old key moves to its new place before the schema sees it; an override's old
path is renamed before it is applied, so ``actor.lr=1e-5`` still overrides the file's
``actor.optim.lr``. A file that sets a field under both names is refused: which one it means is
not ours to guess.
"""

from __future__ import annotations

import logging
from typing import Any

from spmd_rl.config.errors import ConfigError, Violation

log = logging.getLogger("spmd_rl")

UNTIL = "0.3"
"""The release that stops reading the old names."""

_SECTIONS = {
    "actor.optim": ("lr", "lr_schedule", "warmup_steps", "weight_decay", "betas", "grad_clip"),
    "actor.loss": ("policy_loss", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coef", "loss_agg_mode"),
    "actor.correction": ("tis_cap", "icepop_band", "mis_band"),
    "rollout.vllm": ("gpu_memory_utilization", "enforce_eager"),
}
RENAMED: dict[str, str] = {
    f"{section.split('.')[0]}.{name}": f"{section}.{name}" for section, names in _SECTIONS.items() for name in names
} | {
    "actor.router_replay": "actor.moe.router_replay",
    "actor.moe_aux_loss_coef": "actor.moe.aux_loss_coef",
    "actor.moe_z_loss_coef": "actor.moe.z_loss_coef",
    "trainer.eval_interval": "eval.interval",
    "trainer.eval_limit": "eval.limit",
}
"""old dotted path -> new dotted path."""


def _note(old: str, source: str) -> None:
    log.warning("%s: %s is now %s; the old name is read until %s: rename it", source, old, RENAMED[old], UNTIL)


def rename_path(path: list[str], source: str = "overrides") -> list[str]:
    """An override's dotted path with a renamed field's new path (and a warning)."""
    old = ".".join(path)
    if old not in RENAMED:
        return path
    _note(old, source)
    return RENAMED[old].split(".")


def rename_tree(tree: dict[str, Any], source: str) -> dict[str, Any]:
    """``tree`` (a parsed config file, changed in place) with every old key moved to its new path."""
    clashes = []
    for old, new in RENAMED.items():
        section, leaf = old.split(".")
        parent = tree.get(section)
        if not isinstance(parent, dict) or leaf not in parent:
            continue
        node, parts = tree, new.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if parts[-1] in node:
            clashes.append(Violation(old, parent[leaf], f"set twice: also as {new}", f"keep {new} only"))
            continue
        _note(old, source)
        node[parts[-1]] = parent.pop(leaf)
    if clashes:
        raise ConfigError(clashes, source)
    return tree
