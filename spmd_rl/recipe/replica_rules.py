"""Rules of elastic replicas (``elastic.replicas``, ``spmd_rl.elastic.replicas``).

A lost replica's iteration is redone by the survivors from the state it started from, so an
iteration must change no training state before its one optimizer step, which commits only when
every replica got through it: one mini-batch, one epoch, no critic (a second model's step). The
objective must be split-invariant across replicas with nothing but the normaliser summed over
them: per-sample or per-group advantages (not REINFORCE++'s batch whitening), and a fixed deal of
prompt groups (no dynamic sampling, partial rollout or separated placement, whose selections
are the dock's and span the whole batch). Each replica needs at least one unit of prompt groups
(``Replicas.deal``)."""

from __future__ import annotations

import math

from spmd_rl.config.errors import Violation
from spmd_rl.config.layout import Layouts
from spmd_rl.config.schema import Config
from spmd_rl.recipe.graph import Modes, algorithm


def deal_unit(lay: Layouts) -> int:
    """Prompt groups dealt to a replica at a time: its share splits evenly over both its DP layouts."""
    return math.lcm(lay.gen.dp, lay.train.dp)


def check_replicas(cfg: Config, lay: Layouts) -> list[Violation]:
    r = cfg.elastic.replicas
    if r is None:
        return []
    modes, field = Modes.of(cfg), "elastic.replicas"
    off = [
        (cfg.actor.backend != "fsdp", "actor.backend", cfg.actor.backend, "use actor.backend=fsdp"),
        (
            algorithm(cfg).advantage != "sequence",
            "algorithm.name",
            cfg.algorithm.name,
            "use a per-sample or per-group estimator (grpo, rloo, ...): this one's advantage spans the batch or "
            "trains a critic",
        ),
        (modes.dynamic_sampling, "algorithm.name", cfg.algorithm.name, "use grpo, or dapo without dynamic sampling"),
        (modes.partial_rollout, "stream.partial_tokens", cfg.stream.partial_tokens, "set it to 0"),
        (modes.separated, "parallel.placement", "separated", "use parallel.placement=colocated"),
        (cfg.actor.ppo_epochs != 1, "actor.ppo_epochs", cfg.actor.ppo_epochs, "set it to 1"),
        (
            cfg.actor.mini_batch_size != cfg.data.global_batch_size,
            "actor.mini_batch_size",
            cfg.actor.mini_batch_size,
            f"set it to data.global_batch_size ({cfg.data.global_batch_size}): one optimizer step per iteration",
        ),
    ]
    out = [
        Violation(name, value, f"not supported with {field}: a lost replica's iteration is redone from its start", fix)
        for bad, name, value, fix in off
        if bad
    ]
    if r.min_replicas > r.count:
        out.append(Violation(f"{field}.min_replicas", r.min_replicas, f"above {field}.count={r.count}", "lower it"))
    units = cfg.data.global_batch_size // deal_unit(lay)
    if units < r.count:
        out.append(
            Violation(
                f"{field}.count",
                r.count,
                f"the {cfg.data.global_batch_size} prompt groups make {units} shares of {deal_unit(lay)} (the "
                f"replica's DP sizes' lcm), fewer than the replicas",
                f"use at most {units} replicas or a larger data.global_batch_size",
            )
        )
    return out
