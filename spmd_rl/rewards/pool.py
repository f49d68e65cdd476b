"""Rewards run concurrently, each call under a deadline (``reward.workers``, ``reward.timeout_s``).

At most ``workers`` calls run at once, each on its own daemon thread. A call that raises, returns
something that is not a score (``registry.score_of``), or is still running ``timeout_s`` after it
started scores ``failure_score`` and is counted; its slot is freed at once, so one hung verifier
neither stalls the rank nor starves the calls after it. Python cannot stop a thread: a hung call
keeps its (daemon) thread until it returns or the process exits; a verifier that may hang for
good belongs in a service or a subprocess of its own.

A batched reward (``reward.batched``) is called as ``fn(responses, answers, rows) -> [score]``
on ``workers`` contiguous chunks of the share, each chunk one call under the same rules.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spmd_rl.rewards.registry import score_of

log = logging.getLogger("spmd_rl")


@dataclass
class Scored:
    """The scores of one share, with what went wrong: ``failures`` calls that raised or returned
    no score, ``timeouts`` that ran past the deadline (each scored the failure value)."""

    scores: list[float]
    metrics: list[dict[str, float]]
    failures: int = 0
    timeouts: int = 0
    first_error: str | None = None


@dataclass
class _Call:
    args: tuple
    thread: threading.Thread | None = None
    started: float = 0.0
    value: Any = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class RewardPool:
    def __init__(
        self, fn: Callable, rule: str, workers: int, timeout_s: float, failure_score: float, batched: bool = False
    ):
        self.fn, self.rule, self.workers, self.timeout_s = fn, rule, workers, timeout_s
        self.failure_score, self.batched = failure_score, batched

    def score(self, responses: list[str], answers: list[str], rows: list[dict]) -> Scored:
        """Every sample's score and metrics, in order (module docstring)."""
        if not self.batched:
            calls = [_Call((r, a, w)) for r, a, w in zip(responses, answers, rows)]
            self._run(calls)
            return self._single(calls)
        size = max(1, -(-len(responses) // self.workers))
        spans = [range(s, min(s + size, len(responses))) for s in range(0, len(responses), size)]
        calls = [_Call(([responses[i] for i in s], [answers[i] for i in s], [rows[i] for i in s])) for s in spans]
        self._run(calls)
        return self._batched(calls, spans, len(responses))

    def _run(self, calls: list[_Call]) -> None:
        """Start each call when a slot is free; a call ends when it returns or its deadline passes."""
        waiting, running = list(reversed(calls)), []
        while waiting or running:
            while waiting and len(running) < self.workers:
                call = waiting.pop()
                call.thread = threading.Thread(target=self._call, args=(call,), daemon=True, name="reward")
                call.started = time.monotonic()
                call.thread.start()
                running.append(call)
            now = time.monotonic()
            for call in list(running):
                if call.done.is_set():
                    running.remove(call)
                elif now - call.started > self.timeout_s:
                    call.error = "timeout"
                    running.remove(call)  # its thread is abandoned (module docstring)
            if running:
                next_deadline = min(c.started for c in running) + self.timeout_s - now
                running[0].done.wait(max(0.0, min(0.01, next_deadline)))

    def _call(self, call: _Call) -> None:
        try:
            call.value = self.fn(*call.args)
        except Exception as exc:  # any error of a user's reward is a failed call, not a crashed rank
            call.error = f"{type(exc).__name__}: {exc}"
        call.done.set()

    def _outcome(self, call: _Call, out: Scored) -> bool:
        """Count a failed or timed-out call; whether it succeeded."""
        if call.error is None:
            return True
        if call.error == "timeout":
            out.timeouts += 1
        else:
            out.failures += 1
        out.first_error = out.first_error or call.error
        return False

    def _single(self, calls: list[_Call]) -> Scored:
        out = Scored([], [])
        for call in calls:
            if self._outcome(call, out):
                try:
                    score, metrics = score_of(call.value, self.rule)
                except TypeError as exc:
                    call.error, call.value = str(exc), None
                    self._outcome(call, out)
                    score, metrics = self.failure_score, {}
            else:
                score, metrics = self.failure_score, {}
            out.scores.append(score)
            out.metrics.append(metrics)
        return self._logged(out)

    def _batched(self, calls: list[_Call], spans: list[range], n: int) -> Scored:
        out = Scored([self.failure_score] * n, [{} for _ in range(n)])
        for call, span in zip(calls, spans):
            if not self._outcome(call, out):
                continue
            values = call.value
            if not isinstance(values, (list, tuple)) or len(values) != len(span):
                call.error = f"returned {type(values).__name__} for {len(span)} samples, not a list of {len(span)}"
                self._outcome(call, out)
                continue
            try:
                scored = [score_of(v, self.rule) for v in values]
            except TypeError as exc:
                call.error = str(exc)
                self._outcome(call, out)
                continue
            for i, (score, metrics) in zip(span, scored):
                out.scores[i], out.metrics[i] = score, metrics
        return self._logged(out)

    def _logged(self, out: Scored) -> Scored:
        if out.failures or out.timeouts:
            log.warning(
                "reward.rule=%s: %d call(s) failed and %d ran past reward.timeout_s=%g, each scored "
                "reward.failure_score=%g; the first: %s",
                self.rule,
                out.failures,
                out.timeouts,
                self.timeout_s,
                self.failure_score,
                out.first_error,
            )
        return out


def pool_of(reward, fn: Callable) -> RewardPool:
    """The pool the ``reward`` section describes, around ``fn`` (the run's rule or service)."""
    name = reward.url if reward.kind == "remote" else reward.rule
    batched = reward.batched or reward.kind == "remote"
    return RewardPool(fn, name, reward.workers, reward.timeout_s, reward.failure_score, batched)
