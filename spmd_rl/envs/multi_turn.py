"""Multi-turn rollouts: many trajectories through one in-process rollout engine at once.

Continuous batching across trajectories: a trajectory's next turn is submitted to the engine
as soon as its tool returns, while the other trajectories' turns are still generating (vLLM
schedules requests continuously). Tools run in a thread pool beside the engine loop, so a slow
tool holds up only its own trajectory. ``lockstep=True`` is the baseline peers call "turn
synchronous": every trajectory's turn t is submitted together once all of turn t - 1 and its
tools are done (``tools/bench_multi_turn.py`` compares the two).

Budgets per trajectory: at most ``max_turns`` sampled turns and ``max_tokens`` response tokens
(sampled + inserted; each turn may sample what is left). Partial rollout continues
trajectories across iterations (``advance`` with ``segment`` = B): each samples at most B more
tokens per call and is then paused, mid-turn or before its next turn; the next iteration
rebuilds it from the dock's tokens (``Trajectory.replay``), wherever the dock deals it. A tool call that has not
returned after ``tool_timeout_s`` becomes an error observation (``tool_timeouts``) and the trajectory
goes on; an environment that raises becomes an error observation (``tool_errors``). Turn t of
trajectory k is seeded ``request_seed(seed, its seed key, t)`` (the rollout stage's key: the sample's
dataset row x N + its place in its group), so a rerun samples the same trajectories wherever
the dock deals them.
"""

from __future__ import annotations

import hashlib
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch.distributed as dist

from spmd_rl.data.sampling import SamplingSpec
from spmd_rl.envs.base import EnvironmentFactory, Step, Turn
from spmd_rl.envs.trajectory import Trajectory
from spmd_rl.envs.turn_sync import END, GO, PAUSE, share

log = logging.getLogger("spmd_rl")


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int
    max_tokens: int
    tool_timeout_s: float


class MultiTurnRollout:
    def __init__(
        self,
        engine,
        tokenizer,
        factory: EnvironmentFactory,
        limits: TurnLimits,
        lockstep: bool = False,
        tool_workers: int = 8,
        tp_group=None,
    ):
        """``tp_group``: the generation group's TP ranks, which run the rollout together; only
        its first rank steps the environments (``envs.turn_sync``)."""
        self.engine, self.tokenizer, self.factory, self.limits = engine, tokenizer, factory, limits
        self.lockstep, self.tool_workers, self.tp_group = lockstep, tool_workers, tp_group
        self.leader = tp_group is None or dist.get_rank() == dist.get_global_rank(tp_group, 0)

    def start(self, items: list[tuple[list[int], dict]], seed_keys: list[int] | None = None) -> list[Trajectory]:
        """One new trajectory per (prompt ids, dataset row); the row (with its ``prompt`` text)
        makes the trajectory's environment. ``seed_keys``: each one's seed key (default: its place
        in ``items``; ``Trajectory.seed_key``)."""
        keys = seed_keys if seed_keys is not None else list(range(len(items)))
        return [
            Trajectory(
                k, list(ids), [{"role": "user", "content": str(row["prompt"])}], self.factory(row), seed_key=keys[k]
            )
            for k, (ids, row) in enumerate(items)
        ]

    def run(
        self,
        items: list[tuple[list[int], dict]],
        seed: int | None = None,
        temperature: float | None = None,
        seed_keys: list[int] | None = None,
        top_p: float | None = None,
    ) -> list[Trajectory]:
        """New trajectories run to their end; ``top_p``: their nucleus (None: the engine's)."""
        return self.advance(self.start(items, seed_keys), seed, temperature, top_p=top_p)

    def advance(
        self,
        trajs: list[Trajectory],
        seed: int | None = None,
        temperature: float | None = None,
        segment: int | None = None,
        top_p: float | None = None,
    ) -> list[Trajectory]:
        """Run every unfinished trajectory until it ends or, with ``segment``, has sampled that
        many more tokens (then it is paused: not done). Trajectory k of the list is keyed k."""
        for k, t in enumerate(trajs):
            t.key = k
        self._spent, self._segment = [0] * len(trajs), segment
        ready = [t for t in trajs if not t.done]
        tools: dict[Future, tuple[Trajectory, float]] = {}
        pending = False  # the leader's tools still running (the same value on every TP rank)
        pool = ThreadPoolExecutor(self.tool_workers, thread_name_prefix="spmd-rl-tool")
        try:
            while ready or pending or self.engine.busy():
                if ready and (not self.lockstep or not (pending or self.engine.busy())):
                    self._submit(ready, seed, temperature, top_p)
                    ready = []
                if self.engine.busy():
                    for key, (sample,) in self.engine.step():
                        self._sampled(trajs[key], sample, pool, tools)
                elif tools:
                    wait(
                        list(tools),
                        timeout=max(0.0, min(d for _, d in tools.values()) - time.monotonic()),
                        return_when=FIRST_COMPLETED,
                    )
                decided = self._returned(tools) if self.leader else []
                going, pending = share(decided, bool(tools), trajs, self.tp_group)
                ready += going
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a tool past its timeout is left to its own limits
        return trajs

    def _left(self, t: Trajectory) -> int:
        """Tokens the trajectory may sample next: what its budget and this call's segment leave."""
        left = self.limits.max_tokens - len(t.ids)
        return left if self._segment is None else min(left, self._segment - self._spent[t.key])

    def _submit(
        self, trajs: list[Trajectory], seed: int | None, temperature: float | None, top_p: float | None
    ) -> None:
        temp = self.engine.temperature if temperature is None else temperature
        specs = [
            SamplingSpec(
                self._left(t),
                temp,
                None if seed is None else request_seed(seed, t.seed_key, t.stats["turns"]),
                top_p=top_p,
            )
            for t in trajs
        ]
        self.engine.submit([(t.key, t.context) for t in trajs], specs)

    def _sampled(self, t: Trajectory, sample, pool: ThreadPoolExecutor, tools: dict) -> None:
        text = t.add_sampled(sample.token_ids, sample.logprobs, sample.stopped, self.tokenizer)
        self._spent[t.key] += len(sample.token_ids)
        if len(t.ids) >= self.limits.max_tokens or (not sample.stopped and self._segment is None):
            t.finish("truncations")
        elif sample.stopped and self.leader:
            tools[pool.submit(t.env.step, Turn(text, tuple(t.ids[t.turn_start :])))] = (
                t,
                time.monotonic() + self.limits.tool_timeout_s,
            )
        # else: the segment is spent mid-turn; the trajectory is paused with its turn open

    def _returned(self, tools: dict[Future, tuple[Trajectory, float]]) -> list[tuple[Trajectory, list[int], int]]:
        """Apply every tool step that returned or timed out: (trajectory, tokens inserted,
        ``turn_sync`` status) of each; one whose segment is spent pauses before its next turn."""
        now, decided = time.monotonic(), []
        for fut, (t, deadline) in list(tools.items()):
            if fut.done():
                step = _result(fut)
            elif now >= deadline:
                fut.cancel()
                step = Step(
                    observation=f"error: the tool call timed out after {self.limits.tool_timeout_s:g} s",
                    metadata={"tool_calls": 1, "tool_timeouts": 1},
                )
            else:
                continue
            del tools[fut]
            before = len(t.ids)
            goes = t.apply(step, self.tokenizer, self.limits.max_tokens, self.limits.max_turns)
            decided.append((t, t.ids[before:], END if not goes else GO if self._left(t) > 0 else PAUSE))
        return decided


def request_seed(seed: int, sample: int, turn: int) -> int:
    """The sampling seed of one turn request: a 62-bit hash of (the call's seed, the sample's
    seed key, the turn). An affine form (seed + sample x max_turns + turn, as before)
    gave rank 0's trajectory 16 the seeds of rank 1's trajectory 0 when the call's seed carried
    the rank's first index."""
    digest = hashlib.blake2b(f"{seed}:{sample}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _result(fut: Future) -> Step:
    """The environment's step, or an error observation when it raised."""
    try:
        return fut.result()
    except Exception as exc:  # the environment's failure is the policy's observation, not the run's crash
        log.warning(
            "environment step raised %s: %s (returned to the policy as an error observation)", type(exc).__name__, exc
        )
        return Step(observation=f"error: {type(exc).__name__}: {exc}", metadata={"tool_calls": 1, "tool_errors": 1})
