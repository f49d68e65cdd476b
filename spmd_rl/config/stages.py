"""The worker states (stages) of one iteration and the sample columns they read and write.

This is the single description of the sample flow: the trainer runs these stages through the
dock, and the estimates derive the paper's n (response-length items), M (scalars per sample)
and C (controllers = stages) from it. A stage is present only when the config needs it:
the reference pass only with a KL term, the old-log-prob pass only when the update is
off-policy (several PPO epochs or several mini-batches per iteration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spmd_rl.config.schema import Config

ColumnKind = Literal["prompt", "response", "scalar"]

COLUMNS: dict[str, ColumnKind] = {
    "prompt_ids": "prompt",
    "answer": "prompt",
    "response_ids": "response",
    "rollout_log_prob": "response",
    "ref_log_prob": "response",
    "old_log_prob": "response",
    "values": "response",
    "advantages": "response",
    "returns": "response",
    "response_length": "scalar",
    "reward": "scalar",
    "seq_advantage": "scalar",
}
"""Every column a stage may write, by length class. The sample index is implicit (one scalar).
``advantages`` are per token (PPO's GAE); ``seq_advantage`` is one scalar per sample (GRPO and
DAPO: a group-normalised reward, the same for every token). ``answer`` is the reference answer
of the sample's prompt as UTF-8 bytes, written with the prompt by the data loader."""

DATA_COLUMNS = ("prompt_ids", "answer")
"""Written by the data loader (``put_prompts``), before the first stage."""


@dataclass(frozen=True)
class Stage:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    group_granular: bool = False
    """True when the stage needs all N samples of a prompt together (group advantages)."""


def needs_reference(cfg: Config) -> bool:
    return cfg.algorithm.kl_coef > 0


def dynamic_sampling(cfg: Config) -> bool:
    return cfg.algorithm.name == "dapo" and cfg.algorithm.dynamic_sampling


def generation_rounds(cfg: Config) -> int:
    """Most rounds of G prompts one iteration may generate: 1, plus DAPO dynamic sampling's
    ``algorithm.max_extra_rounds``."""
    return 1 + (cfg.algorithm.max_extra_rounds if dynamic_sampling(cfg) else 0)


def ref_micro_batch_size(cfg: Config) -> int:
    """Samples per reference forward: ``ref.micro_batch_size``, else the actor's."""
    return cfg.ref.micro_batch_size or cfg.actor.micro_batch_size


def needs_old_log_prob(cfg: Config) -> bool:
    """Off-policy update: the policy moves before the last mini-batch is consumed."""
    return cfg.actor.ppo_epochs > 1 or cfg.actor.mini_batch_size < cfg.data.global_batch_size


def stages_for(cfg: Config) -> list[Stage]:
    """The stage graph of one iteration, in execution order. Invariants (tested): each stage
    reads exactly its ``inputs`` from the dock (the stages ask this graph what to get), and
    every column written is read by a later stage."""
    seq = ("prompt_ids", "response_ids")
    out = [
        Stage("actor_rollout", ("prompt_ids",), ("response_ids", "rollout_log_prob", "response_length")),
        Stage("reward", ("response_ids", "response_length", "answer"), ("reward",)),
    ]
    extra: tuple[str, ...] = ("rollout_log_prob",)
    if needs_reference(cfg):
        out.append(Stage("ref_logprob", seq, ("ref_log_prob",)))
        extra += ("ref_log_prob",)
    if needs_old_log_prob(cfg):
        out.append(Stage("actor_logprob", seq, ("old_log_prob",)))
        extra += ("old_log_prob",)
    if cfg.algorithm.name == "ppo":
        out.append(Stage("critic_value", seq, ("values",)))
        out.append(Stage("advantage", ("reward", "values", "response_length"), ("advantages", "returns")))
        out.append(Stage("critic_update", seq + ("values", "returns"), ()))
    else:
        out.append(Stage("advantage", ("reward",), ("seq_advantage",), group_granular=True))
    out.append(Stage("actor_update", seq + (advantage_column(cfg),) + extra, ()))
    return out


def advantage_column(cfg: Config) -> str:
    return "advantages" if cfg.algorithm.name == "ppo" else "seq_advantage"


def stage_inputs(cfg: Config, name: str) -> list[str]:
    """The dock columns stage ``name`` reads, from the graph."""
    for s in stages_for(cfg):
        if s.name == name:
            return list(s.inputs)
    raise KeyError(f"stage {name!r} is not in this config's graph")


def written_columns(stages: list[Stage]) -> list[str]:
    cols: list[str] = list(DATA_COLUMNS)
    for s in stages:
        cols += [c for c in s.outputs if c not in cols]
    return cols


def flow_counts(stages: list[Stage]) -> tuple[int, int, int]:
    """(n, M, C) of the paper: response-length columns, scalars per sample (+1 for the index),
    and controllers (one per stage)."""
    cols = written_columns(stages)
    n = sum(COLUMNS[c] == "response" for c in cols)
    m = sum(COLUMNS[c] == "scalar" for c in cols) + 1
    return n, m, len(stages)
