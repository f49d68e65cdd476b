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

from spmd_rl.algos.specs import AlgorithmSpec, spec_named
from spmd_rl.config.schema import Config

ColumnKind = Literal["prompt", "response", "scalar", "routes"]

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
    "response_version": "response",
    "prompt_row": "scalar",
    "prefix_ids": "response",
    "prefix_log_prob": "response",
    "prefix_version": "response",
    "prefix_done": "scalar",
    "prefix_routes": "routes",
    "prefix_mask": "response",
    "prefix_env_reward": "scalar",
    "reward": "scalar",
    "seq_advantage": "scalar",
    "rollout_routes": "routes",
    "response_mask": "response",
    "env_reward": "scalar",
    "agent_prompt_ids": "prompt",
}
"""Every column a stage may write, by length class. The sample index is implicit (one scalar).
``advantages`` are per token (PPO's GAE); ``seq_advantage`` is one scalar per sample (GRPO and
DAPO: a group-normalised reward, the same for every token). ``answer`` is the reference answer
of the sample's prompt as UTF-8 bytes, written with the prompt by the data loader. Partial
rollout adds ``response_version`` (the policy version, i.e. the number of updates, that
generated each token) and the data loader's ``prefix_*`` (the response so far of a continued sample, empty for a new
one, and whether it already finished). Multi-turn rollouts (``rollout.environment``) add ``response_mask`` (1 on
sampled tokens, 0 on inserted ones: every stage that computes per-token terms reads it) and
``env_reward`` (the environment's summed reward contributions). Agent rollouts (``rollout.agent``) also
write ``agent_prompt_ids``: the prompt the agent's first call of the trained segment rendered
(its own system message and tools), which the training stages read in place of ``prompt_ids``."""

DATA_COLUMNS = ("prompt_ids", "answer", "prompt_row")
"""Written by the data loader (``put_prompts``), before the first stage. ``prompt_row`` is the
prompt's dataset row: partial rollout carries groups by it, and the update reads it so the
prompt ledger records the rows it trained as observed in the dock (``trainer.ledger``)."""

PARTIAL_COLUMNS = ("prefix_ids", "prefix_log_prob", "prefix_version", "prefix_done")
"""Also written by the data loader under partial rollout (``trainer.partial``)."""

PREFIX_ROUTES = ("prefix_routes",)
"""Also written under partial rollout when routes are recorded: the ``rollout_routes`` of each
sample's response so far, which its continuation extends (``trainer.carry.Piece``)."""

PREFIX_TURNS = ("prefix_mask", "prefix_env_reward")
"""Also written under partial rollout of multi-turn trajectories: the ``response_mask`` and
``env_reward`` of each sample's response so far; the rollout rebuilds the trajectory from its
tokens and mask (``envs.trajectory.Trajectory.replay``)."""

PREFIX_EXTRA = PREFIX_ROUTES + PREFIX_TURNS


ROLES = ("rollout", "actor", "ref", "critic", "reward_model")
"""The engines a stage can need on the device: the rollout engine (vLLM weights + KV cache),
the actor's training state, the frozen reference, PPO's critic (training state) and the
reward model."""


@dataclass(frozen=True)
class Stage:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    roles: tuple[str, ...] = ()
    """The engines that must be resident while the stage runs; every other one is on host."""
    group_granular: bool = False
    """True when the stage needs all N samples of a prompt together (generation, group advantages)."""
    layout: Literal["train", "gen"] = "train"
    """Whose DP layout splits the stage's samples: the training engines' or the rollout engine's."""
    per_round: bool = False
    """Runs once per generation round (DAPO dynamic sampling repeats generation and reward)."""
    mini_batched: bool = False
    """Reads its samples by mini-batch (``actor.mini_batch_size`` prompt groups, in the batch's
    order; the forward stages share the update's order and micro-batches): each mini-batch is
    shared over the DP ranks on its own (``dock.controller.split``'s parts), so a mini-batch is
    the same samples whatever the layout, or the replicas' deal (``elastic.replicas``)."""
    whole_batch: bool = False
    """Computes statistics of the iteration's whole batch (REINFORCE++'s and PPO's whitening over
    every token): it cannot run per streamed wave, so it is never fused."""
    fn: str = ""
    """The compute function: empty for the stage registered under ``name``
    (``trainer.stages.registry``), or a user's ``module:function`` (an algorithm spec's
    ``advantage_stage``)."""


def algorithm(cfg: Config) -> AlgorithmSpec:
    """The spec of ``algorithm.name`` (``algos.specs``): what every algorithm-dependent choice reads."""
    return spec_named(cfg.algorithm.name)


@dataclass(frozen=True)
class Modes:
    """What the run is: every mode a stage, a rule or the loop branches on, derived from the
    config in one place (``Modes.of``) and built once per run (``trainer.context.Run.modes``).
    A new mode is one field here and its formula in ``of``; callers never re-derive it from
    config fields."""

    algorithm: AlgorithmSpec
    """The spec of ``algorithm.name`` (``algos.specs``)."""
    needs_reference: bool
    """A reference pass: ``algorithm.kl_coef > 0``, or a preference algorithm (DPO)."""
    dynamic_sampling: bool
    """DAPO's dynamic sampling: a DAPO spec and ``algorithm.dynamic_sampling``."""
    partial_rollout: bool
    """``stream.partial_tokens > 0``: responses continue across iterations (``trainer.partial``)."""
    separated: bool
    """``parallel.placement: separated``: generation on ranks of its own."""
    records_routes: bool
    """The rollout writes ``rollout_routes``: ``actor.moe.router_replay`` record or rollout."""
    multi_turn: bool
    """Rollouts are multi-turn trajectories: ``rollout.environment`` (``envs.multi_turn``) or
    ``rollout.agent`` (``gateway``) is set."""
    agent: bool
    """The trajectories are an agent's calls to the gateway (``rollout.agent``): each sample
    carries its own prompt, ``agent_prompt_ids``."""
    off_policy: bool
    """The policy moves before the last mini-batch is consumed: ``actor.ppo_epochs > 1`` or
    ``actor.mini_batch_size < data.global_batch_size``."""
    kl_in_reward: bool
    """``use_kl_loss: false`` with a reference: beta x KL(pi_old || ref) per token is subtracted
    from the rewards."""
    generation_rounds: int
    """Most rounds of G prompts one iteration may generate: 1, plus dynamic sampling's
    ``algorithm.max_extra_rounds``."""

    @classmethod
    def of(cls, cfg: Config) -> Modes:
        spec = algorithm(cfg)
        reference = cfg.algorithm.kl_coef > 0 or spec.advantage == "preference"
        dynamic = spec.dapo and cfg.algorithm.dynamic_sampling
        return cls(
            algorithm=spec,
            needs_reference=reference,
            dynamic_sampling=dynamic,
            partial_rollout=cfg.stream.partial_tokens > 0,
            separated=cfg.parallel.placement == "separated",
            records_routes=cfg.actor.moe.router_replay != "none",
            multi_turn=cfg.rollout.environment is not None or cfg.rollout.agent is not None,
            agent=cfg.rollout.agent is not None,
            off_policy=cfg.actor.ppo_epochs > 1 or cfg.actor.mini_batch_size < cfg.data.global_batch_size,
            kl_in_reward=reference and not cfg.algorithm.use_kl_loss,
            generation_rounds=1 + (cfg.algorithm.max_extra_rounds if dynamic else 0),
        )

    @property
    def versioned(self) -> bool:
        """Samples may come from an older policy than the one trained (partial rollout, separated
        placement): the rollout records each token's policy version (``response_version``)."""
        return self.partial_rollout or self.separated

    @property
    def needs_old_log_prob(self) -> bool:
        """The actor's own log-probs before the update: the off-policy ratio's denominator, or
        the policy side of KL-in-reward."""
        return self.off_policy or self.kl_in_reward


def prompt_column(m: Modes) -> str:
    """The column holding each sample's prompt for the training stages: the agent's own under
    ``rollout.agent``, else the data loader's."""
    return "agent_prompt_ids" if m.agent else "prompt_ids"


def reference_roles(cfg: Config) -> tuple[str, ...]:
    """What the reference pass makes resident: the frozen reference, or with ``actor.lora`` the
    actor itself (the reference is the actor with adapters off, ``engines.training.lora``)."""
    return ("actor",) if cfg.actor.lora else ("ref",)


def partial_columns(cfg: Config) -> tuple[str, ...]:
    """The data loader's ``prefix_*`` columns of this config (none without partial rollout)."""
    m = Modes.of(cfg)
    if not m.partial_rollout:
        return ()
    return PARTIAL_COLUMNS + (PREFIX_ROUTES if m.records_routes else ()) + (PREFIX_TURNS if m.multi_turn else ())


def data_columns(cfg: Config) -> tuple[str, ...]:
    return DATA_COLUMNS + partial_columns(cfg)


def ref_micro_batch_size(cfg: Config) -> int:
    """Samples per reference forward: ``ref.micro_batch_size``, else the actor's."""
    return cfg.ref.micro_batch_size or cfg.actor.micro_batch_size


def stages_for(cfg: Config) -> list[Stage]:
    """The stage graph of one iteration, in execution order. Invariants (tested): each stage
    reads exactly its ``inputs`` from the dock, every column written is read by a later stage,
    and only the stage's ``roles`` are resident while it runs."""
    m = Modes.of(cfg)
    spec = m.algorithm
    if spec.advantage == "preference":
        return dpo_stages(cfg)
    turns: tuple[str, ...] = ("response_mask",) if m.multi_turn else ()
    seq = (prompt_column(m), "response_ids") + turns
    routes: tuple[str, ...] = ("rollout_routes",) if m.records_routes else ()
    out = _sampling_stages(cfg, m, turns, routes)
    update_extra: tuple[str, ...] = ("rollout_log_prob",) + (("response_version",) if m.versioned else ()) + routes
    kl_cols: tuple[str, ...] = ()
    if m.needs_reference:
        out.append(Stage("ref_logprob", seq, ("ref_log_prob",), reference_roles(cfg), mini_batched=True))
        if m.kl_in_reward:
            kl_cols = ("ref_log_prob", "old_log_prob", "response_length")
        else:
            update_extra += ("ref_log_prob",)
    if m.needs_old_log_prob:
        replayed = routes if cfg.actor.moe.router_replay == "rollout" else ()
        out.append(Stage("actor_logprob", seq + replayed, ("old_log_prob",), ("actor",), mini_batched=True))
        if m.off_policy:
            update_extra += ("old_log_prob",)
    out += _advantage_stages(spec, seq, kl_cols, turns)
    update_in = seq + (advantage_column(cfg), "prompt_row") + update_extra
    out.append(Stage("actor_update", update_in, (), ("actor",), mini_batched=True))
    return out


def _sampling_stages(cfg: Config, m: Modes, turns: tuple[str, ...], routes: tuple[str, ...]) -> list[Stage]:
    """Rollout (with the carried columns of partial rollouts, the versions, the recorded routes
    and the tool turns) and reward (a rule's, an environment's, or a reward model's)."""
    model_reward = cfg.reward.kind == "model"
    partial = m.partial_rollout
    return [
        Stage(
            "actor_rollout",  # the row seeds the samples (and starts an environment)
            ("prompt_ids", "prompt_row") + (partial_columns(cfg) if partial else ()),
            ("response_ids", "rollout_log_prob", "response_length")
            + (("response_version",) if m.versioned else ())
            + routes
            + (turns + ("env_reward",) if turns else ())
            + (("agent_prompt_ids",) if m.agent else ()),
            ("rollout",),
            group_granular=True,
            layout="gen",
            per_round=True,
        ),
        Stage(
            "reward",
            (("prompt_ids",) if model_reward else ())
            + ("response_ids", "response_length", "answer", "prompt_row")
            + (turns + ("env_reward",) if turns else ()),
            ("reward",),
            ("reward_model",) if model_reward else (),
            per_round=True,
        ),
    ]


def _advantage_stages(
    spec: AlgorithmSpec, seq: tuple[str, ...], kl_cols: tuple[str, ...], turns: tuple[str, ...]
) -> list[Stage]:
    """The advantage: GAE from a critic (with its value and update stages), per-token returns
    (REINFORCE++), or a sequence advantage over each group."""
    out: list[Stage] = []
    if spec.critic:
        out.append(Stage("critic_value", seq, ("values",), ("critic",), mini_batched=True))
        adv_in = ("reward", "values", "response_length") + tuple(c for c in kl_cols if c != "response_length") + turns
        out.append(Stage("advantage", adv_in, ("advantages", "returns"), whole_batch=True))
        out.append(Stage("critic_update", seq + ("values", "returns"), (), ("critic",), mini_batched=True))
    elif spec.advantage == "token":  # REINFORCE++: per-token returns, whitened over the batch
        adv_in = ("reward", "response_length") + tuple(c for c in kl_cols if c != "response_length") + turns
        out.append(
            Stage(
                "advantage",
                adv_in,
                ("advantages",),
                group_granular=spec.group_relative,
                whole_batch=True,
            )
        )
    elif spec.advantage_stage:  # a user's stage: KL in the reward is refused with it (rules)
        out.append(
            Stage(
                "advantage",
                spec.advantage_inputs,
                ("seq_advantage",),
                group_granular=spec.group_relative,
                fn=spec.advantage_stage,
            )
        )
    else:
        out.append(
            Stage(
                "advantage", ("reward",) + kl_cols + (turns if kl_cols else ()), ("seq_advantage",), group_granular=True
            )
        )
    return out


def dpo_stages(cfg: Config) -> list[Stage]:
    """DPO's graph (``trainer.stages.preference``): no rollout. The data loader puts each
    prompt twice (``rollout.n`` = 2), the pair's responses come from the dataset (sample 2q
    chosen, 2q + 1 rejected), then the reference's log-probs of both and the update over whole
    pairs."""
    seq = ("prompt_ids", "response_ids")
    return [
        Stage("preference_pairs", ("prompt_row",), ("response_ids",), (), group_granular=True, per_round=True),
        Stage("ref_logprob", seq, ("ref_log_prob",), reference_roles(cfg)),
        Stage("dpo_update", seq + ("ref_log_prob", "prompt_row"), (), ("actor",), group_granular=True),
    ]


def fused_stages(cfg: Config, graph: list[Stage]) -> list[Stage]:
    """With ``stream.fuse``: the stages that run while generation runs (``trainer.fusion``), in
    graph order. Such a stage makes nothing resident (the rollout engine stays) and every input
    is written by the data loader, the rollout or an earlier fused stage. A stage that is not
    per-round joins only without dynamic sampling, which picks the groups after every round; a
    whole-batch stage never joins (a wave's moments are not the batch's)."""
    if not cfg.stream.fuse:
        return []
    ready = set(data_columns(cfg)) | set(graph[0].outputs)
    dynamic = Modes.of(cfg).dynamic_sampling
    out = []
    for s in graph[1:]:
        if not s.roles and not s.whole_batch and set(s.inputs) <= ready and (s.per_round or not dynamic):
            out.append(s)
            ready |= set(s.outputs)
    return out


def pinned_roles(cfg: Config) -> set[str]:
    """Roles the config keeps resident through every stage (their ``offload_to_host: false``;
    the actor under ``reshard.mode: naive``)."""
    keep = {
        "ref": not cfg.ref.offload_to_host,
        "critic": not cfg.critic.offload_to_host,
        "reward_model": not cfg.reward.offload_to_host,
        "actor": cfg.reshard.mode == "naive",
    }
    return {role for role, pinned in keep.items() if pinned}


def resident_roles(cfg: Config, stage: Stage, graph: list[Stage]) -> set[str]:
    """What is resident while ``stage`` of ``graph`` runs: its roles plus the pinned ones the
    graph has; a stage without roles (host-only work) keeps what the stage before it had
    (``reshard.residency``)."""
    present = {r for s in graph for r in s.roles}
    k = graph.index(stage)
    while not graph[k].roles and k > 0:
        k -= 1
    return set(graph[k].roles) | (pinned_roles(cfg) & present)


def advantage_column(cfg: Config) -> str:
    """Per-token ``advantages`` (PPO's GAE, REINFORCE++'s returns) or one ``seq_advantage`` per sample."""
    return algorithm(cfg).column


def written_columns(stages: list[Stage]) -> list[str]:
    cols: list[str] = list(DATA_COLUMNS) + [c for c in PARTIAL_COLUMNS + PREFIX_EXTRA if c in stages[0].inputs]
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
