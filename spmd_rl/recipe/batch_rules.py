"""Batch rules: the global batch, its prompt groups and samples, split evenly over both DP
layouts, then the mini- and micro-batches (``data.global_batch_size``, ``rollout.n``,
``actor.*_batch_size``, ``ref.micro_batch_size``)."""

from __future__ import annotations


from spmd_rl.config.errors import Violation
from spmd_rl.config.layout import Layouts
from spmd_rl.config.schema import Config
from spmd_rl.recipe.graph import algorithm


def multiple(n: int, k: int) -> int:
    """Smallest positive multiple of k that is >= n."""
    return max(k, -(-n // k) * k)


def check_batches(cfg: Config, lay: Layouts) -> list[Violation]:
    """G prompts x N samples split evenly over both DP layouts (whole groups where the estimator
    reads them), then the mini- and micro-batches (``check_minibatches``)."""
    out: list[Violation] = []
    g, n = cfg.data.global_batch_size, cfg.rollout.n
    tdp, gdp = lay.train.dp, lay.gen.dp
    if g % gdp:
        out.append(
            Violation(
                "data.global_batch_size",
                g,
                f"not divisible by the generation DP size {gdp}",
                f"use a multiple of {gdp}, e.g. {multiple(g, gdp)}",
            )
        )
    if (g * n) % tdp:
        out.append(
            Violation(
                "data.global_batch_size",
                g,
                f"G x N = {g * n} samples not divisible by the training DP size {tdp}",
                f"make G x rollout.n a multiple of {tdp}",
            )
        )
    spec = algorithm(cfg)
    if spec.group_relative and g % tdp:
        out.append(
            Violation(
                "data.global_batch_size",
                g,
                f"{cfg.algorithm.name} gives whole prompt groups to the {tdp} training DP groups; "
                f"{g} groups leave some with {g // tdp} and others with {g // tdp + 1} (or none), and their "
                f"collectives stop matching",
                f"use a multiple of the training DP size {tdp}, e.g. {multiple(g, tdp)}, or a smaller "
                f"parallel.train.dp_shard",
            )
        )
    return out + check_minibatches(cfg, lay)


def check_minibatches(cfg: Config, lay: Layouts) -> list[Violation]:
    """Mini-batches divide G (whole pairs per DP group for DPO) and split over training DP;
    micro-batches divide a rank's share; a token budget holds one full-length sample."""
    out: list[Violation] = []
    g, n, tdp, spec = cfg.data.global_batch_size, cfg.rollout.n, lay.train.dp, algorithm(cfg)
    mb = cfg.actor.mini_batch_size
    if g % mb:
        out.append(
            Violation(
                "actor.mini_batch_size",
                mb,
                f"does not divide data.global_batch_size={g}",
                "use a divisor of the global batch size",
            )
        )
    elif spec.advantage == "preference" and mb % tdp:  # the one update that reads a group (its pair) whole
        out.append(
            Violation(
                "actor.mini_batch_size",
                mb,
                f"dpo splits each mini-batch's whole pairs over the {tdp} training DP groups: "
                f"{mb} groups do not split evenly (ranks would take different numbers of optimizer steps)",
                f"use a multiple of {tdp} that divides data.global_batch_size={g}",
            )
        )
    elif (mb * n) % tdp:
        out.append(
            Violation(
                "actor.mini_batch_size",
                mb,
                f"mini-batch x N = {mb * n} samples not divisible by the training DP size {tdp}",
                f"make mini_batch_size x rollout.n a multiple of {tdp}",
            )
        )
    else:
        per_rank = mb * n // tdp
        for field, micro in (
            ("actor.micro_batch_size", cfg.actor.micro_batch_size),
            ("ref.micro_batch_size", cfg.ref.micro_batch_size),
        ):
            if micro is not None and per_rank % micro:
                out.append(
                    Violation(
                        field,
                        micro,
                        f"does not divide the {per_rank} samples each rank gets per mini-batch",
                        f"use a divisor of {per_rank}",
                    )
                )
    budget, longest = cfg.actor.micro_batch_tokens, cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if budget is not None and budget < longest:
        out.append(
            Violation(
                "actor.micro_batch_tokens",
                budget,
                f"is below one full-length sample (data.max_prompt_length + rollout.max_response_length = {longest})",
                f"use at least {longest}, or null for micro_batch_size samples per micro-batch",
            )
        )
    return out
