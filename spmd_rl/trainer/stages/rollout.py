"""actor_rollout: N responses per prompt group from the rollout engine (generation layout,
group-granular: a generation DP group receives whole prompt groups). Each sample is seeded by
the iteration and its seed key, dataset row x N + its place in its group (``_seed_keys``), so a
rerun of the iteration samples the same responses however its prompts are dealt over DP groups,
rounds or elastic replicas (whose docks number their shares from 0).

``rollout_groups`` yields each prompt group as the engine finishes it (stage fusion streams
them into the dock); the stage function collects them all, so both paths write the same
samples. Under elastic replicas it first yields the groups this rank already generated in the
iteration (``elastic.replicas.FinishedGroups``): the redo after a peer's loss generates only the
groups that were not this rank's (the lost replica's), as the same seeds would anyway.

Under partial rollout (``stream.partial_tokens`` = B) every unfinished sample is continued
from its prefix (the data loader's ``prefix_*`` columns) by at most B tokens, seeded by its
seed key; a sample is finished once it stopped or holds ``rollout.max_response_length``
tokens. Each new token is tagged with the policy version ``it`` (the number of updates so
far). Under separated placement every token is tagged with the version of the weights the
generator holds (``Run.progress.policy_version``), up to ``stream.max_policy_lag`` behind ``it``.

With ``rollout.environment`` every sample is a multi-turn trajectory (``envs.multi_turn``:
sampled turns with tool turns inserted between them, all of the share's trajectories through the
engine at once); the stage also writes ``response_mask`` and ``env_reward`` and sums the
trajectories' turn and tool counts (``envs.trajectory.STATS``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from spmd_rl.distributed import timeline
from spmd_rl.engines.base import Sample
from spmd_rl.envs.trajectory import STATS, Trajectory
from spmd_rl.gateway.records import AGENT_STATS
from spmd_rl.trainer.carry import Piece
from spmd_rl.recipe.graph import Modes
from spmd_rl.trainer.stages.registry import StageCall, StageResult, register


def _seed(call: StageCall) -> int:
    """The iteration's base seed; a request adds its seed key (``_seed_keys``)."""
    return call.view.cfg.trainer.seed * 1_000_003 + call.it * 10_007


def _seed_keys(call: StageCall) -> list[int]:
    """Each sample's seed key: its dataset row x N + its place in its group (groups are N
    consecutive indices), never its place in the share or the dock."""
    n = call.view.cfg.rollout.n
    return [int(r) * n + int(i) % n for r, i in zip(call.batch.columns["prompt_row"], call.batch.indices)]


def rollout_groups(call: StageCall) -> Iterator[tuple[list[int], list[Sample]]]:
    """(sample indices, samples) of the prompt groups of this share that each engine step
    finished, in finishing order."""
    view, batch = call.view, call.batch
    n = view.cfg.rollout.n
    idx = batch.indices.tolist()
    if not idx:
        return
    if view.turns is not None:  # trajectories finish in any order; the groups are handed over together
        yield idx, [_as_sample(t, view.modes.agent) for t in _trajectories(call)]
        return
    firsts, keys, seed = batch.columns["prompt_ids"][::n], _seed_keys(call)[::n], _seed(call)
    done = call.view.replicas.finished if call.view.replicas is not None else None
    todo = list(range(len(keys)))
    if done is not None:  # elastic replicas: the groups this rank generated before a peer's loss
        done.begin(seed)
        kept = [p for p in todo if keys[p] in done.groups]
        todo = [p for p in todo if keys[p] not in done.groups]
        done.reused += len(kept)
        if kept:
            yield [i for p in kept for i in idx[p * n : (p + 1) * n]], [s for p in kept for s in done.groups[keys[p]]]
    if not todo:
        return
    for step in view.rollout.generate_stream(
        [firsts[p].tolist() for p in todo],
        n=n,
        max_tokens=view.cfg.rollout.max_response_length,
        seed=seed,
        seed_keys=[keys[p] for p in todo],
    ):
        if done is not None:
            done.groups.update((keys[todo[q]], samples) for q, samples in step)
        yield (
            [i for q, _ in step for i in idx[todo[q] * n : (todo[q] + 1) * n]],
            [s for _, samples in step for s in samples],
        )


def rollout_columns(samples: list[Sample]) -> dict[str, object]:
    """The rollout's columns; ``rollout_routes`` when the engine records routes."""
    out: dict[str, object] = {
        "response_ids": [torch.tensor(s.token_ids, dtype=torch.int32) for s in samples],
        "rollout_log_prob": [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples],
        "response_length": torch.tensor([len(s.token_ids) for s in samples], dtype=torch.int32),
    }
    if samples and samples[0].routes is not None:
        out["rollout_routes"] = [s.routes for s in samples]
    if samples and samples[0].mask is not None:
        out["response_mask"] = [torch.tensor(s.mask, dtype=torch.uint8) for s in samples]
        out["env_reward"] = torch.tensor([s.env_reward for s in samples], dtype=torch.float32)
    if samples and samples[0].prompt_ids is not None:
        out["agent_prompt_ids"] = [torch.tensor(s.prompt_ids, dtype=torch.int32) for s in samples]
    return out


def _trajectories(call: StageCall) -> list[Trajectory]:
    """One multi-turn trajectory per sample of the share, in index order."""
    view, cols = call.view, call.batch.columns
    items = [(p.tolist(), view.prompts.environment_row(int(r))) for p, r in zip(cols["prompt_ids"], cols["prompt_row"])]
    if view.modes.agent:  # the calls record the weight version the engine holds
        version = view.policy_version if view.modes.versioned else call.it
        return view.turns.run(items, seed=_seed(call), seed_keys=_seed_keys(call), version=version)
    return view.turns.run(items, seed=_seed(call), seed_keys=_seed_keys(call))


def _as_sample(t: Trajectory, agent: bool) -> Sample:
    prompt = t.prompt if agent else None
    return Sample(
        t.ids, t.logprobs, t.stopped, mask=t.mask, env_reward=t.reward, stats=dict(t.stats), prompt_ids=prompt
    )


@register("actor_rollout")
def actor_rollout(call: StageCall) -> StageResult:
    with timeline.span("generate"):
        return _rollout(call)


def _rollout(call: StageCall) -> StageResult:
    partial = call.view.modes.partial_rollout
    if not len(call.batch):
        return StageResult(pieces={} if partial else None, sums=turn_sums(call.view.modes, []))
    if partial:
        return _continue(call)
    by_index = {i: s for indices, samples in rollout_groups(call) for i, s in zip(indices, samples)}
    samples = [by_index[i] for i in call.batch.indices.tolist()]
    out = rollout_columns(samples)
    if call.view.modes.versioned:  # separated placement: the version of the weights the engine holds
        out["response_version"] = [
            torch.full((len(s.token_ids),), call.view.policy_version, dtype=torch.int32) for s in samples
        ]
    return StageResult(columns=out, sums=turn_sums(call.view.modes, samples))


def turn_sums(modes: Modes, samples: list[Sample]) -> dict[str, float]:
    """The multi-turn counts of these samples: every key on every rank under
    ``rollout.environment`` (the sums are all-reduced by key), none otherwise."""
    if not modes.multi_turn:
        return {}
    keys = STATS + (AGENT_STATS if modes.agent else ())
    return {k: float(sum(s.stats.get(k, 0) for s in samples)) for k in keys}


def _continue(call: StageCall) -> StageResult:
    cfg, cols = call.view.cfg, call.batch.columns
    limit = cfg.rollout.max_response_length
    routes = cols.get("prefix_routes", [None] * len(call.batch))
    pieces = [
        Piece.of(row, ids, lp, ver, done, r if r is None or r.numel() else None)
        for row, ids, lp, ver, done, r in zip(
            cols["prompt_row"],
            cols["prefix_ids"],
            cols["prefix_log_prob"],
            cols["prefix_version"],
            cols["prefix_done"],
            routes,
        )
    ]
    if call.view.turns is not None:
        return _continue_turns(call, pieces)
    todo, keys = [k for k, p in enumerate(pieces) if not p.done], _seed_keys(call)
    got = call.view.rollout.continue_samples(
        [
            (
                cols["prompt_ids"][k].tolist() + pieces[k].token_ids,
                min(cfg.stream.partial_tokens, limit - len(pieces[k].token_ids)),
            )
            for k in todo
        ],
        seed=_seed(call),
        seed_keys=[keys[k] for k in todo],
    )
    for k, s in zip(todo, got):
        pieces[k].extend(s, call.it, limit)
    out = rollout_columns([Sample(p.token_ids, p.logprobs, routes=p.routes) for p in pieces])
    out["response_version"] = [torch.tensor(p.versions, dtype=torch.int32) for p in pieces]
    return StageResult(columns=out, pieces=dict(zip(call.batch.indices.tolist(), pieces)))


def _continue_turns(call: StageCall, pieces: list[Piece]) -> StageResult:
    """Partial rollout of multi-turn trajectories: each unfinished sample is rebuilt from the
    dock's tokens and mask (``Trajectory.replay``: a fresh environment, its turns fed again;
    whichever generation group the dock dealt it to) and advanced by at most B sampled tokens.
    A trajectory's counts are summed once, in the iteration it ends."""
    view, cols, lim = call.view, call.batch.columns, call.view.turns.limits
    trajs = view.turns.start(
        [(p.tolist(), view.prompts.environment_row(int(r))) for p, r in zip(cols["prompt_ids"], cols["prompt_row"])],
        seed_keys=_seed_keys(call),
    )
    todo = []
    for t, p, m, reward in zip(trajs, pieces, cols["prefix_mask"], cols["prefix_env_reward"]):
        p.mask, p.env_reward = m.tolist(), float(reward)
        if not p.done and (
            not p.token_ids
            or t.replay(
                p.token_ids,
                p.logprobs,
                p.mask,
                view.tokenizer,
                lim.max_tokens,
                lim.max_turns,
                p.env_reward,
                lim.tool_timeout_s,
            )
        ):
            todo.append(t)
    view.turns.advance(todo, seed=_seed(call), segment=view.cfg.stream.partial_tokens)
    samples, ended = [], []
    for p, t in zip(pieces, trajs):
        ended.append(not p.done and t.done)  # its counts are summed in the iteration it ends
        if not p.done:
            p.versions += [call.it] * (len(t.ids) - len(p.token_ids))
            p.token_ids, p.logprobs, p.mask, p.done, p.env_reward = (
                list(t.ids),
                list(t.logprobs),
                list(t.mask),
                t.done,
                t.reward,
            )
        samples.append(
            Sample(
                p.token_ids, p.logprobs, mask=p.mask, env_reward=p.env_reward, stats=dict(t.stats) if ended[-1] else {}
            )
        )
    out = rollout_columns(samples)
    out["response_version"] = [torch.tensor(p.versions, dtype=torch.int32) for p in pieces]
    return StageResult(
        columns=out, pieces=dict(zip(call.batch.indices.tolist(), pieces)), sums=turn_sums(view.modes, samples)
    )
