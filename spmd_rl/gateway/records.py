"""What the gateway records of one agent trajectory: the exact tokens of every call, and which
calls form the sample that is trained.

A trajectory is the calls made with one API key. Each call's prompt is rendered by the chat
template once and tokenized once; what the policy samples is recorded as token ids with their
log-probs and the weight version. A later call *continues* the trajectory when its prompt
extends a served call (one of its choices, a ``Tip``) in one of two ways:

1. by messages: the request's messages begin with the served call's messages plus the assistant
   message the gateway returned (compared by role, text, and tool-call names and parsed
   arguments; call ids are ignored). The new context is then the served context, exactly as
   sampled, plus the tokens the template puts after that assistant turn (its separator, or its
   end-of-turn token where the sample was cut) and the rendering of the new messages;
2. by tokens: the rendering of the request begins with the served context, token for token.

The sampled tokens are never re-tokenized from the text the agent sends back, so a template
that re-serializes tool-call JSON, or text that tokenizes differently, changes nothing.

A call that continues no tip starts a new *segment*: the agent edited its history (dropped or
rewrote a turn). That is the prefix check of in-process multi-turn rollouts (``envs.trajectory``)
at the gateway: the trajectory is split, counted in ``agent_splits``, and the sampled tokens of
the earlier segments in ``agent_dropped_tokens``. The trained sample is the last segment (it
holds the final answer the reward scores); its response is every token after its first prompt,
the mask 1 on sampled tokens and 0 on the inserted ones.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

Render = Callable[[list[dict], bool], list[int]]
"""(messages, add the generation prompt) -> token ids: the chat template with the call's tools."""

AGENT_STATS = ("agent_splits", "agent_dropped_tokens", "agent_failures", "tool_parse_errors")
"""Counts of agent trajectories beside ``envs.trajectory.STATS`` (summed the same way)."""


def _text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI's content parts: their text, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _arguments(raw: object) -> object:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def normalize(message: dict) -> tuple:
    """A message as the continuation check compares it: role, text, name, and the tool calls'
    names and parsed arguments (ids ignored: clients rewrite them)."""
    calls = tuple(
        (
            c.get("function", {}).get("name"),
            json.dumps(_arguments(c.get("function", {}).get("arguments")), sort_keys=True),
        )
        for c in message.get("tool_calls") or ()
    )
    return (message.get("role"), _text(message.get("content")).strip(), message.get("name") or "", calls)


@dataclass
class Tip:
    """One served choice of the trajectory's last call: the segment as it stands if the next
    call continues this choice."""

    messages: tuple[tuple, ...]
    """The call's messages and the assistant message served, normalized."""
    request_render: list[int]
    """The template's rendering of the call's messages (with the generation prompt)."""
    prompt: list[int]
    """The segment's first prompt."""
    ids: list[int]
    logprobs: list[float]
    mask: list[int]
    versions: list[int]
    stopped: bool
    """The choice ended on a stop token (its last sampled token)."""
    text: str
    """The choice's content as served (what a reward rule scores)."""

    @property
    def context(self) -> list[int]:
        return self.prompt + self.ids


@dataclass
class Plan:
    """How one call is served: its prompt, the tip it continues (None: a new segment) and the
    tokens inserted after that tip."""

    prompt: list[int]
    tip: Tip | None
    inserted: list[int]
    request_render: list[int]

    @property
    def response_so_far(self) -> int:
        """Response tokens the segment holds before this call samples."""
        return 0 if self.tip is None else len(self.tip.ids) + len(self.inserted)


def _turn_tail(tip: Tip, pre: list[int], end_ids: frozenset[int]) -> list[int] | None:
    """The tokens the template puts after the served assistant turn: after its stop token when
    the choice stopped, from the template's end-of-turn token when it was cut; None when the
    rendering of the served conversation does not start with the call's own rendering."""
    head = tip.request_render
    if pre[: len(head)] != head:
        return None
    turn = pre[len(head) :]
    ends = [j for j, t in enumerate(turn) if t in end_ids]
    if not ends:
        return None
    return turn[ends[0] + 1 :] if tip.stopped else turn[ends[0] :]


@dataclass
class AgentRecord:
    """One trajectory's calls (module docstring). Thread-safe: an agent may call concurrently."""

    end_ids: frozenset[int]
    """The tokenizer's end-of-turn ids (its EOS and the generation config's)."""
    tips: list[Tip] = field(default_factory=list)
    stats: Counter = field(default_factory=lambda: Counter(trajectories=1))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call_number(self) -> int:
        """This call's number in the trajectory (what its sampling seed derives from)."""
        with self.lock:
            self.stats["calls"] += 1
            return self.stats["calls"] - 1

    def plan(self, messages: list[dict], render: Render) -> Plan:
        """The prompt of a call with these messages: a continuation of a tip, or a new segment."""
        full = render(messages, True)
        seen = tuple(normalize(m) for m in messages)
        with self.lock:
            tips = list(self.tips)
        for tip in tips:
            if seen[: len(tip.messages)] == tip.messages:
                pre = render(messages[: len(tip.messages)], False)
                tail = _turn_tail(tip, pre, self.end_ids) if full[: len(pre)] == pre else None
                if tail is not None:
                    inserted = tail + full[len(pre) :]
                    return Plan(tip.context + inserted, tip, inserted, full)
            ctx = tip.context
            if full[: len(ctx)] == ctx:
                return Plan(full, tip, full[len(ctx) :], full)
        return Plan(full, None, [], full)

    def plan_tokens(self, prompt: list[int]) -> Plan:
        """The plan of a call that sends token ids or raw text (``/v1/completions``): a
        continuation by tokens only."""
        with self.lock:
            tips = list(self.tips)
        for tip in tips:
            ctx = tip.context
            if prompt[: len(ctx)] == ctx:
                return Plan(prompt, tip, prompt[len(ctx) :], prompt)
        return Plan(prompt, None, [], prompt)

    def record(self, plan: Plan, messages: list[dict], served: list[tuple[object, dict, str]], version: int) -> None:
        """Record a served call: ``served`` holds each choice's (sample, assistant message as
        returned, content text); the choices become the tips the next call may continue."""
        seen = tuple(normalize(m) for m in messages)
        with self.lock:
            base = plan.tip
            if base is None and self.tips:  # the agent edited its history: a new segment
                self.stats["agent_splits"] += 1
                self.stats["agent_dropped_tokens"] += sum(self.tips[0].mask)
            self.stats["turns"] += 1
            self.tips = [self._tip(plan, seen, s, msg, text, version) for s, msg, text in served]

    @staticmethod
    def _tip(plan: Plan, seen: tuple, sample, message: dict, text: str, version: int) -> Tip:
        base, ins, got = plan.tip, plan.inserted, sample.token_ids
        prompt = plan.prompt if base is None else base.prompt
        ids = ([] if base is None else base.ids + ins) + list(got)
        return Tip(
            messages=seen + (normalize(message),),
            request_render=plan.request_render,
            prompt=list(prompt),
            ids=ids,
            logprobs=([] if base is None else base.logprobs + [0.0] * len(ins)) + list(sample.logprobs),
            mask=([] if base is None else base.mask + [0] * len(ins)) + [1] * len(got),
            versions=([] if base is None else base.versions + [version] * len(ins)) + [version] * len(got),
            stopped=sample.stopped,
            text=text,
        )

    def trained(self) -> Tip | None:
        """The segment that is trained: the last call's first choice (None: no call was made)."""
        with self.lock:
            return self.tips[0] if self.tips else None
