"""Multi-turn rollouts: many trajectories through one in-process rollout engine at once.

Continuous batching across trajectories: a trajectory's next turn is submitted to the engine
as soon as its tool returns, while the other trajectories' turns are still generating (vLLM
schedules requests continuously). Tools run in a thread pool beside the engine loop, so a slow
tool holds up only its own trajectory. ``lockstep=True`` is the baseline peers call "turn
synchronous": every trajectory's turn t is submitted together once all of turn t - 1 and its
tools are done (``tools/bench_multi_turn.py`` compares the two).

Budgets per trajectory: at most ``max_turns`` sampled turns and ``max_tokens`` response tokens
(sampled + inserted; each turn may sample what is left). A tool call that has not returned
after ``tool_timeout_s`` becomes an error observation (``tool_timeouts``) and the trajectory
goes on; an environment that raises becomes an error observation (``tool_errors``). Turn t of
trajectory k is seeded seed + k * max_turns + t, so a rerun samples the same trajectories.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from spmd_rl.envs.base import EnvironmentFactory, Step, Turn
from spmd_rl.envs.trajectory import Trajectory

log = logging.getLogger("spmd_rl")


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int
    max_tokens: int
    tool_timeout_s: float


class MultiTurnRollout:
    def __init__(self, engine, tokenizer, factory: EnvironmentFactory, limits: TurnLimits, lockstep: bool = False,
                 tool_workers: int = 8):
        self.engine, self.tokenizer, self.factory, self.limits = engine, tokenizer, factory, limits
        self.lockstep, self.tool_workers = lockstep, tool_workers

    def run(self, items: list[tuple[list[int], dict]], seed: int | None = None, temperature: float | None = None) -> list[Trajectory]:
        """One trajectory per (prompt ids, dataset row), run to its end; the row (with its
        ``prompt`` text) makes the trajectory's environment."""
        trajs = [Trajectory(k, list(ids), [{"role": "user", "content": str(row["prompt"])}], self.factory(row))
                 for k, (ids, row) in enumerate(items)]
        ready = list(trajs)
        tools: dict[Future, tuple[Trajectory, float]] = {}
        pool = ThreadPoolExecutor(self.tool_workers, thread_name_prefix="spmd-rl-tool")
        try:
            while ready or tools or self.engine.busy():
                if ready and (not self.lockstep or not (tools or self.engine.busy())):
                    self._submit(ready, seed, temperature)
                    ready = []
                if self.engine.busy():
                    for key, (sample,) in self.engine.step():
                        self._sampled(trajs[key], sample, pool, tools)
                elif tools:
                    wait(list(tools), timeout=max(0.0, min(d for _, d in tools.values()) - time.monotonic()), return_when=FIRST_COMPLETED)
                ready += self._returned(tools)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a tool past its timeout is left to its own limits
        return trajs

    def _submit(self, trajs: list[Trajectory], seed: int | None, temperature: float | None) -> None:
        lim = self.limits
        params = [self.engine.sampling_params(lim.max_tokens - len(t.ids), temperature,
                                              None if seed is None else seed + t.key * lim.max_turns + t.stats["turns"]) for t in trajs]
        self.engine.submit([(t.key, t.context) for t in trajs], params)

    def _sampled(self, t: Trajectory, sample, pool: ThreadPoolExecutor, tools: dict) -> None:
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        t.add_sampled(sample.token_ids, sample.logprobs, text, sample.stopped)
        if not sample.stopped or len(t.ids) >= self.limits.max_tokens:
            t.finish("truncations")
            return
        tools[pool.submit(t.env.step, Turn(text, tuple(sample.token_ids)))] = (t, time.monotonic() + self.limits.tool_timeout_s)

    def _returned(self, tools: dict[Future, tuple[Trajectory, float]]) -> list[Trajectory]:
        """Apply every tool step that returned or timed out; the trajectories that go on."""
        now, going = time.monotonic(), []
        for fut, (t, deadline) in list(tools.items()):
            if fut.done():
                step = _result(fut)
            elif now >= deadline:
                fut.cancel()
                step = Step(observation=f"error: the tool call timed out after {self.limits.tool_timeout_s:g} s",
                            metadata={"tool_calls": 1, "tool_timeouts": 1})
            else:
                continue
            del tools[fut]
            if t.apply(step, self.tokenizer, self.limits.max_tokens, self.limits.max_turns):
                going.append(t)
        return going


def _result(fut: Future) -> Step:
    """The environment's step, or an error observation when it raised."""
    try:
        return fut.result()
    except Exception as exc:  # the environment's failure is the policy's observation, not the run's crash
        log.warning("environment step raised %s: %s (returned to the policy as an error observation)", type(exc).__name__, exc)
        return Step(observation=f"error: {type(exc).__name__}: {exc}", metadata={"tool_calls": 1, "tool_errors": 1})
