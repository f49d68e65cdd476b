"""What each algorithm is, as data: the stage graph, the config rules, the stages and the data
loader read an algorithm's :class:`AlgorithmSpec`, never its name (verl keeps the same facts in
``AdvantageEstimator`` branches spread over its trainer). Torch-free: ``spmd-rl validate`` and
the launcher read it.

A user's algorithm needs no edit to the package: ``algorithm.name: my_pkg.algos:SPEC`` names
an ``AlgorithmSpec`` in the user's module, imported when the config is checked (keep that
module light: it is imported by ``validate``), and its ``estimator`` names a function in
``module:function`` form, imported by the advantage stage: for ``advantage="sequence"``
``(rewards [B] float64, N, norm_adv_by_std) -> advantages [B]`` over contiguous groups of N
samples; for ``advantage="token"`` ``(token rewards [B, T] float64, mask [B, T], gamma) ->
[B, T]``, whitened over the batch after it (``algos.estimators``).

Invariant: a spec's ``name`` is the ``algorithm.name`` that selects it (built-ins register
under their name, a user's spec is named by its ``module:attribute`` path).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Literal

from spmd_rl.catalog import Registry, findable

AdvantageKind = Literal["sequence", "token", "gae", "preference"]


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    advantage: AdvantageKind
    """sequence: one scalar per sample from ``estimator`` (the ``seq_advantage`` column);
    token: per-token advantages from ``estimator`` (REINFORCE++'s discounted returns), whitened
    over the batch (``advantages``);
    gae: a critic and GAE (``advantages``, ``returns``; the critic stages); preference:
    offline (chosen, rejected) pairs, no rollout (DPO's graph, ``estimator`` its loss)."""
    estimator: str = ""
    """sequence: the estimator (a name in ``algos.estimators.SEQ_ESTIMATORS`` or a user's
    ``module:function``); preference: the loss (``algos.preference``); else unused."""
    group_relative: bool = False
    """Its per-sample computation reads the sample's prompt group (mean, std, leave-one-out,
    the pair): every training DP rank holds whole groups, the same number on each."""
    centre_scores: bool = False
    """token: each score minus its group's mean before the returns (REINFORCE++-baseline)."""
    std_normalised: bool = False
    """It divides by the group's reward std unless ``algorithm.norm_adv_by_std: false``."""
    dapo: bool = False
    """DAPO's extras apply: dynamic sampling, the overlong buffer, decoupled clip ratios."""
    advantage_stage: str = ""
    """A user's advantage stage in place of the built-in one (``advantage="sequence"`` only), as
    ``module:function``: ``(trainer.stages.registry.StageCall) -> StageResult`` whose
    ``columns={"seq_advantage": tensor [B]}`` holds one advantage per sample of ``call.batch``
    (whole prompt groups of N, in order, when ``group_relative``; possibly none: then return
    ``StageResult()``, with no columns). It reads ``call.batch.columns[c]`` for ``c`` in
    ``advantage_inputs``, runs on each rank's share and must enter no collective (ranks' shares
    differ, empty ones included). ``estimator`` is then unused. Where the estimator sees only
    the rewards, the stage sees any column written before it (the response lengths, the
    rollout's log-probs)."""
    advantage_inputs: tuple[str, ...] = ("reward",)
    """The columns ``advantage_stage`` reads (``recipe.graph.COLUMNS``; ``validate`` refuses one
    that no stage before it writes)."""

    @property
    def critic(self) -> bool:
        """A value model is trained beside the actor (PPO)."""
        return self.advantage == "gae"

    @property
    def discounted(self) -> bool:
        """It reads ``algorithm.gamma`` (token returns or GAE)."""
        return self.advantage in ("token", "gae")

    @property
    def column(self) -> str:
        """The advantage column the update reads."""
        return "seq_advantage" if self.advantage == "sequence" else "advantages"

    @property
    def needs_group_of_two(self) -> bool:
        """It compares a response with the other responses to its prompt, so N >= 2."""
        return self.group_relative and self.advantage != "preference"


ALGORITHMS: Registry[AlgorithmSpec] = Registry("algorithm", "; or a user's spec as module:attribute")

for _spec in (
    AlgorithmSpec("grpo", "sequence", "grpo", group_relative=True, std_normalised=True),
    AlgorithmSpec("dapo", "sequence", "grpo", group_relative=True, std_normalised=True, dapo=True),
    AlgorithmSpec("rloo", "sequence", "rloo", group_relative=True),
    AlgorithmSpec("reinforce_pp", "token", "returns"),
    AlgorithmSpec("reinforce_pp_baseline", "token", "returns", group_relative=True, centre_scores=True),
    AlgorithmSpec("ppo", "gae"),
    AlgorithmSpec("dpo", "preference", "dpo", group_relative=True),
):
    ALGORITHMS[_spec.name] = _spec


@functools.cache
def spec_named(name: str) -> AlgorithmSpec:
    """The spec ``algorithm.name`` selects: a built-in, or ``module:attribute`` naming a user's
    ``AlgorithmSpec`` (ValueError, naming what is wrong, otherwise)."""
    if ":" not in name:
        return ALGORITHMS.lookup(name)
    module, _, attr = name.partition(":")
    try:
        spec = getattr(importlib.import_module(module), attr, None)
    except ImportError as e:
        raise ValueError(f"algorithm {name!r}: module {module!r} not importable ({e})") from e
    if not isinstance(spec, AlgorithmSpec):
        raise ValueError(f"algorithm {name!r}: {module}.{attr} is not an AlgorithmSpec")
    if spec.name != name:
        raise ValueError(f"algorithm {name!r}: the spec is named {spec.name!r}; name it by its path, {name!r}")
    if ":" in spec.estimator and not findable(spec.estimator):
        raise ValueError(
            f"algorithm {name!r}: its estimator {spec.estimator!r} cannot be found (module not on the path, or not "
            "module:function)"
        )
    if spec.advantage_stage and (spec.advantage != "sequence" or not findable(spec.advantage_stage)):
        raise ValueError(
            f"algorithm {name!r}: its advantage_stage {spec.advantage_stage!r} must be a findable module:function of "
            f"a sequence-advantage spec (this one's advantage is {spec.advantage!r})"
        )
    return spec


POLICY_LOSSES: Registry = Registry("policy loss", "; or a user's module:function")
"""``actor.loss.policy_loss`` -> the objective (``algos.policy_loss``, imported by the ranks only);
declared here so that the torch-free config check reads the names from the table itself."""
POLICY_LOSSES.declare("vanilla", "spmd_rl.algos.policy_loss:vanilla_ppo")
POLICY_LOSSES.declare("gspo", "spmd_rl.algos.policy_loss:gspo")
POLICY_LOSSES.declare("cispo", "spmd_rl.algos.policy_loss:cispo")


def check_policy_loss(name: str) -> str:
    """A registered policy objective, or a user's ``module:function`` with the registered ones'
    signature (``algos.policy_loss``), whose module can be found (it is imported by the ranks
    only: it may import torch). ValueError naming what is wrong otherwise."""
    if ":" not in name:
        if name not in POLICY_LOSSES:
            raise ValueError(
                f"unknown policy loss {name!r}; registered: {', '.join(POLICY_LOSSES)}; or a user's module:function"
            )
        return name
    if not findable(name):
        module, _, attr = name.partition(":")
        raise ValueError(f"policy loss {name!r}: module {module!r} not found or {attr!r} not a name")
    return name
