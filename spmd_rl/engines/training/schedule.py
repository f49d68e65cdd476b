"""Learning-rate multipliers: linear warm-up over ``warmup`` steps, then constant, linear decay
to 0 or cosine decay to 0 at ``total`` steps."""

from __future__ import annotations

import math


def lr_factor(step: int, kind: str, warmup: int, total: int) -> float:
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {kind!r}")
