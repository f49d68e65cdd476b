"""Agent rollouts (``rollout.agent``): one agent run per sample, all of a share's agents at once
against this rank's gateway, bounded by ``rollout.gateway.concurrency``.

``run`` has the shape of ``envs.multi_turn.MultiTurnRollout.run``, so the rollout stage and the
held-out evaluation call either: it opens a generation phase on the gateway with one fresh key per
trajectory, runs the agents in their own process (``agent_host``) while ``EnginePump`` serves their
calls on this thread,
then closes the phase (every key dies with it) and returns each trajectory's trained segment
(``gateway.records``) as an ``envs.trajectory.Trajectory``: its own prompt (the agent's first
call in that segment, ``agent_prompt_ids``), the response with its mask and log-probs, the
agent's reward contribution and the counts.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass

from spmd_rl.envs.trajectory import Trajectory
from spmd_rl.gateway.agent_host import AgentHost
from spmd_rl.gateway.app import serve
from spmd_rl.gateway.pump import EnginePump
from spmd_rl.gateway.records import AgentRecord
from spmd_rl.gateway.server import Gateway, Lease, Limits, Phase

log = logging.getLogger("spmd_rl")


@dataclass(frozen=True)
class AgentSettings:
    agent: str
    host: str
    port: int
    concurrency: int
    timeout_s: float


class AgentRollout:
    def __init__(self, engine, tokenizer, settings: AgentSettings, limits: Limits, end_ids: frozenset[int]):
        self.engine, self.tokenizer, self.settings, self.end_ids = engine, tokenizer, settings, end_ids
        self.host: AgentHost | None = None
        self.use(settings.agent)
        self.gateway = Gateway(tokenizer, EnginePump(engine), limits)
        serve(self.gateway, settings.host, settings.port)

    def use(self, agent: str) -> None:
        """Run this agent (``rollout.agent``'s form) from the next phase on."""
        if self.host is not None:
            self.host.close()
        self.host = AgentHost(agent, self.settings.timeout_s, self.settings.concurrency)

    def run(
        self,
        items: list[tuple[list[int], dict]],
        seed: int | None = None,
        temperature: float | None = None,
        seed_keys: list[int] | None = None,
        top_p: float | None = None,
        version: int = 0,
    ) -> list[Trajectory]:
        """One agent run per (dataset prompt ids, row); ``seed_keys`` as the multi-turn rollout's."""
        keys = seed_keys if seed_keys is not None else list(range(len(items)))
        records = [AgentRecord(self.end_ids) for _ in items]
        tokens = [secrets.token_urlsafe(24) for _ in items]
        temp = self.engine.temperature if temperature is None else temperature
        self.gateway.open(Phase(temp, top_p, seed, version), {t: Lease(r, k) for t, r, k in zip(tokens, records, keys)})
        try:
            runs = [self.host.submit(self.gateway.base_url, t, row) for t, (_, row) in zip(tokens, items)]
            deadline = _Deadline(runs, self.settings.timeout_s)
            self.gateway.pump.run_until(deadline.passed)
        finally:
            self.gateway.close()
        return [self._trajectory(k, ids, rec, run) for k, ((ids, _), rec, run) in enumerate(zip(items, records, runs))]

    def _trajectory(self, key: int, dataset_prompt: list[int], rec: AgentRecord, run: Future) -> Trajectory:
        reward = 0.0
        if run.done() and run.exception() is None:
            reward = float(run.result() or 0.0)
        else:
            problem = "timed out" if not run.done() else repr(run.exception())
            log.warning("agent of trajectory %d failed (%s): it contributes 0", key, problem)
            rec.stats["agent_failures"] += 1
        tip = rec.trained()
        stats = Counter(rec.stats)  # a copy: a straggler's late call cannot change what was returned
        stats.pop("calls", None)
        if tip is None:
            return Trajectory(key, list(dataset_prompt), [], None, reward=reward, stats=stats, done=True)
        stats["sampled_tokens"] += sum(tip.mask)
        stats["inserted_tokens"] += len(tip.mask) - sum(tip.mask)
        return Trajectory(
            key,
            tip.prompt,
            [],
            None,
            ids=tip.ids,
            logprobs=tip.logprobs,
            mask=tip.mask,
            reward=reward,
            stopped=tip.stopped,
            done=True,
            stats=stats,
            last_text=tip.text,
        )

    def close(self) -> None:
        self.host.close()
        self.gateway.stop()


class _Deadline:
    """Every agent returned, or ``timeout_s`` passed since they started (the stragglers' keys die
    with the phase; a command is killed by its own timeout)."""

    def __init__(self, runs: list[Future], timeout_s: float):
        self.runs, self.end = runs, time.monotonic() + timeout_s

    def passed(self) -> bool:
        return all(r.done() for r in self.runs) or time.monotonic() > self.end


def agent_rollout(cfg, engine, tokenizer, model_name: str) -> AgentRollout:
    """The agent rollout of a config (``rollout.agent``, ``rollout.gateway``) on this rank's engine."""
    r, g = cfg.rollout, cfg.rollout.gateway
    limits = Limits(
        model=model_name,
        max_model_len=cfg.data.max_prompt_length + r.max_response_length,
        response_budget=r.max_response_length,
        max_request_bytes=g.max_request_kib * 1024,
        max_messages=g.max_messages,
        tool_parser=g.tool_parser,
    )
    settings = AgentSettings(r.agent, g.host, g.port, g.concurrency, g.agent_timeout_s)
    return AgentRollout(engine, tokenizer, settings, limits, end_ids(tokenizer))


def end_ids(tokenizer) -> frozenset[int]:
    """The ids that end an assistant turn: the tokenizer's EOS (one id or several)."""
    eos = tokenizer.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else list(eos or []))
