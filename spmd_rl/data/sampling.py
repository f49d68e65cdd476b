"""What a rollout engine is asked for and what it returns, as plain records: the seam between
the engines (``engines.base.Rollout``) and what drives them (the rollout stage, the multi-turn
loop in ``envs``), which import no engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    """One generated response: token ids and the sampler's log-prob of each, of the distribution
    the token was drawn from (softmax(logits / T), renormalised over the top-k / top-p set when
    those are on)."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool = False
    """Ended on a stop token (EOS), not on the token limit of its request."""
    routes: torch.Tensor | None = None
    """With ``record_routes``: the experts the engine chose at every position of prompt + response
    but the last, flattened [(P + R - 1) x layers x top_k] uint8 (``engines.vllm.route_capture``)."""
    mask: list[int] | None = None
    """A multi-turn trajectory's ``response_mask``: 1 where sampled, 0 where inserted (``envs``)."""
    env_reward: float = 0.0
    """A multi-turn trajectory's summed environment reward."""
    stats: dict[str, int] | None = None
    """A multi-turn trajectory's turn and tool counts (``envs.trajectory.STATS``)."""
    prompt_ids: list[int] | None = None
    """An agent trajectory's own prompt (``gateway.rollout``): the one its tokens follow."""


@dataclass(frozen=True)
class SamplingSpec:
    """One request's sampling, engine-neutral: ``n`` samples of at most ``max_tokens`` tokens at
    ``temperature`` (0: greedy), the request seeded ``seed`` (None: unseeded); top-k comes from
    the engine's rollout config, and top-p too unless ``top_p`` is given (held-out evaluation's
    own, ``eval.top_p``)."""

    max_tokens: int
    temperature: float
    seed: int | None = None
    n: int = 1
    top_p: float | None = None
