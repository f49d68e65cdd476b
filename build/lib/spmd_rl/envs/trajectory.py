"""One multi-turn trajectory, tokens in and tokens out.

The response is the concatenation of the policy's sampled turns and the tokens inserted
between them (tool turns and turn separators). ``mask`` is 1 on sampled tokens, 0 on inserted
ones; ``logprobs`` holds vLLM's sampling log-prob of each sampled token (0 where inserted).
Nothing is ever re-tokenized from text: a text observation is rendered by the chat template,
and the tokens it inserts are the rendering's tokens past the trajectory's own.

Exact-prefix invariant: the template's rendering of the whole conversation so far (prompt
message, each sampled turn as its decoded text, each observation as a ``tool`` message, then
the generation prompt) must begin with exactly prompt + response. If it does not (the template
rewrites an earlier turn, or the decoded text re-tokenizes differently), the trajectory ends
before the observation and counts a ``prefix_breaks``: what is trained is only what was
sampled or inserted, never an altered copy.
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from spmd_rl.envs.base import Environment, Step, Turn

log = logging.getLogger("spmd_rl")

STATS = (
    "trajectories",
    "turns",
    "tool_calls",
    "tool_errors",
    "tool_timeouts",
    "truncations",
    "prefix_breaks",
    "sampled_tokens",
    "inserted_tokens",
)
"""Per-trajectory counts the rollout sums into metrics (``trajectories``: 1 each, the count
the means divide by)."""


def mask_runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) of each maximal run of equal values: a response's sampled turns
    (value 1) and inserted stretches (value 0), in order."""
    runs, j = [], 0
    while j < len(mask):
        k = j
        while k < len(mask) and mask[k] == mask[j]:
            k += 1
        runs.append((j, k, mask[j]))
        j = k
    return runs


@dataclass
class Trajectory:
    key: int
    prompt: list[int]
    messages: list[dict[str, str]]
    """The conversation as the chat template sees it (starts with the prompt's user message)."""
    env: Environment
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    """Sum of the environment's reward contributions."""
    seed_key: int = -1
    """What its sampling seeds are derived from (``multi_turn.request_seed``): the sample's index
    in the iteration's batch, the same on whichever rank and in whichever segment it runs (-1:
    ``key``)."""
    stopped: bool = False
    """The last sampled turn ended on a stop token (not on the token budget)."""
    open_turn: bool = False
    """The last sampled segment did not end its turn: partial rollout paused it mid-turn, and
    the next segment continues the same turn (``envs.multi_turn``, ``segment``)."""
    turn_start: int = 0
    """Where the current (or last) sampled turn starts in ``ids``."""
    done: bool = False
    stats: Counter = field(default_factory=lambda: Counter(trajectories=1))
    last_text: str = ""
    """The text of the last sampled turn (what a reward rule scores)."""

    @property
    def context(self) -> list[int]:
        return self.prompt + self.ids

    def add_sampled(self, token_ids: list[int], logprobs: list[float], stopped: bool, tokenizer) -> str:
        """Append sampled tokens (a new turn, or the rest of an open one); returns the turn's
        text so far, its tokens decoded without special tokens."""
        if not self.open_turn:
            self.turn_start = len(self.ids)
            self.stats["turns"] += 1
            self.messages.append({"role": "assistant", "content": ""})
        self.ids += token_ids
        self.logprobs += logprobs
        self.mask += [1] * len(token_ids)
        self.stats["sampled_tokens"] += len(token_ids)
        self.last_text = tokenizer.decode(self.ids[self.turn_start :], skip_special_tokens=True)
        self.messages[-1]["content"] = self.last_text
        self.stopped, self.open_turn = stopped, not stopped
        return self.last_text

    def add_inserted(self, token_ids: list[int]) -> None:
        self.ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.mask += [0] * len(token_ids)
        self.stats["inserted_tokens"] += len(token_ids)

    def finish(self, reason: str | None = None) -> None:
        if reason is not None:
            self.stats[reason] += 1
        self.done = True

    def apply(self, step: Step, tokenizer, budget: int, max_turns: int) -> bool:
        """Take an environment step; True when the trajectory continues with another turn.
        Ends it when the environment is done, at ``max_turns`` sampled turns, when the
        observation would leave no room for a sampled token within ``budget`` response tokens
        (a truncation), or on a prefix break."""
        self.reward += float(step.reward)
        for k in ("tool_calls", "tool_errors", "tool_timeouts"):
            self.stats[k] += int(step.metadata.get(k, 0))
        if step.done or step.observation is None:
            self.finish()
            return False
        if self.stats["turns"] >= max_turns:
            self.finish("truncations")
            return False
        inserted = self._render(step.observation, tokenizer)
        if inserted is None:
            self.finish("prefix_breaks")
            return False
        if len(self.ids) + len(inserted) >= budget:
            self.finish("truncations")
            return False
        self.add_inserted(inserted)
        return True

    def _render(self, observation: str | list[int], tokenizer) -> list[int] | None:
        """The tokens an observation inserts, or None on a prefix break. Token ids are inserted
        as they are; text becomes a ``tool`` message rendered by the chat template."""
        if not isinstance(observation, str):
            return [int(t) for t in observation]
        messages = self.messages + [{"role": "tool", "content": observation}]
        full = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        ctx = self.context
        if full[: len(ctx)] != ctx:
            return None
        self.messages = messages
        return full[len(ctx) :]

    def replay(
        self,
        ids: list[int],
        logprobs: list[float],
        mask: list[int],
        tokenizer,
        budget: int,
        max_turns: int,
        carried_reward: float = 0.0,
        step_timeout_s: float | None = None,
    ) -> bool:
        """Rebuild a carried trajectory (partial rollout) from its response so far: each sampled
        turn is fed to this trajectory's fresh environment in order, and each observation must
        render to exactly the inserted tokens that follow it. The tokens, log-probs and mask are
        the carried ones whatever happens; False when the environment now answers differently,
        raises, or takes longer than ``step_timeout_s`` (the trajectory then ends there, a
        ``prefix_breaks``, with the ``carried_reward`` its first environment gave, not what the
        fresh one said). A last sampled run not followed by inserted tokens is the turn the
        previous segment left open."""
        runs = mask_runs(mask)
        for n, (a, b, sampled) in enumerate(runs):
            if not sampled:
                continue
            text = self.add_sampled(ids[a:b], logprobs[a:b], n + 1 < len(runs), tokenizer)
            if n + 1 == len(runs):
                return True  # the open turn
            before, kept = len(self.ids), Counter(self.stats)
            step = _bounded_step(self.env, Turn(text, tuple(ids[a:b])), step_timeout_s)
            if (
                step is None
                or not self.apply(step, tokenizer, budget, max_turns)
                or self.ids[before:] != ids[b : runs[n + 1][1]]
            ):
                self.ids, self.logprobs, self.mask, self.done, self.stats = (
                    list(ids),
                    list(logprobs),
                    list(mask),
                    True,
                    kept,
                )
                self.reward = carried_reward
                self.stats["prefix_breaks"] += 1
                return False
        return True


def _bounded_step(env, turn: Turn, timeout_s: float | None) -> Step | None:
    """The environment's step, or None when it raised or outlasted ``timeout_s`` (a replay ends
    there as a prefix break; ``MultiTurnRollout.advance`` makes the same failures observations)."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(env.step, turn).result(timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - the environment's failure, or its timeout
        log.warning(
            "environment step raised or timed out during a replay (%s: %s): a prefix break", type(exc).__name__, exc
        )
        return None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
