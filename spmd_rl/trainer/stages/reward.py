"""reward: one scalar per sample.

- ``reward.kind: rule``: r = rule(decoded response, reference answer);
- ``reward.kind: model``: r = RM(prompt ++ response) + ``rule_weight`` x rule(...), the reward
  model's score taken at the last real token (``engines.fsdp.engine``, head ``score``);
- DAPO's soft overlong penalty is added in both cases;
- multi-turn rollouts (``response_mask`` present): the rule scores the policy's last sampled
  turn (not the tool output inserted before it), and the environment's ``env_reward`` is added.

The rule always runs: "correct" (the accuracy metric) is the rule's score above 0.5, whatever
the reward, so a reward model's run is measured on the same task as a rule's.
"""

from __future__ import annotations

import torch

from spmd_rl.algos.core import overlong_penalty
from spmd_rl.recipe.graph import algorithm, ref_micro_batch_size
from spmd_rl.engines.training.logprobs import split
from spmd_rl.envs.trajectory import mask_runs
from spmd_rl.trainer.stages.registry import StageCall, StageResult, register
from spmd_rl.rewards.pool import pool_of
from spmd_rl.trainer.stages.samples import decode_text, seq_batch


@register("reward")
def reward(call: StageCall) -> StageResult:
    view, batch, cfg = call.view, call.batch, call.view.cfg
    if not len(batch):
        return StageResult(
            sums={"generated": 0.0},
            maxes={"response_length_max": 0.0},
            rewards=torch.zeros(len(call.expected), dtype=torch.float64),
        )
    masks = batch.columns.get("response_mask")
    responses = [
        r.tolist() if masks is None else last_turn(r, masks[k]) for k, r in enumerate(batch.columns["response_ids"])
    ]
    texts = view.tokenizer.batch_decode(responses, skip_special_tokens=True)
    answers = [decode_text(a) for a in batch.columns["answer"]]
    infos = [view.prompts.info(int(r)) for r in batch.columns["prompt_row"]]
    scored = pool_of(cfg.reward, view.reward_fn).score(texts, answers, infos)
    rule = torch.tensor(scored.scores, dtype=torch.float32)
    sums = extra_sums(scored.metrics, cfg.reward.rule) | source_sums(view.prompts, infos, rule)
    sums |= {"reward_failures": float(scored.failures), "reward_timeouts": float(scored.timeouts)}
    if cfg.reward.kind == "model":
        model_score, _ = view.roles["reward_model"].infer(split(seq_batch(view, batch), ref_micro_batch_size(cfg)))
        scores = model_score.float() + cfg.reward.rule_weight * rule
        sums |= {"reward_model_sum": float(model_score.sum()), "reward_rule_sum": float(rule.sum())}
    else:
        scores = rule.clone()
    if masks is not None:
        env = torch.stack(batch.columns["env_reward"]).float()
        scores = scores + env
        sums["env_reward_sum"] = float(env.sum())
    lengths = torch.stack(batch.columns["response_length"])
    algo = cfg.algorithm
    if algorithm(cfg).dapo and algo.overlong_buffer:
        scores = scores + overlong_penalty(
            lengths, cfg.rollout.max_response_length, algo.overlong_buffer, algo.overlong_penalty
        )
    dense = torch.zeros(len(call.expected), dtype=torch.float64)
    if call.writer:
        slot = {i: k for k, i in enumerate(call.expected)}
        dense[[slot[i] for i in batch.indices.tolist()]] = scores.double()
    sums |= {
        "reward_sum": float(scores.sum()),
        "reward_sq": float((scores**2).sum()),
        "correct": float((rule > 0.5).sum()),
        "generated": float(len(batch)),
        "response_tokens": float(lengths.float().sum()),
    }
    return StageResult(
        columns={"reward": scores}, sums=sums, maxes={"response_length_max": float(lengths.max())}, rewards=dense
    )


def extra_sums(metrics: list[dict[str, float]], rule: str) -> dict[str, float]:
    """The sums of a reward's extra metrics (its dict's entries beside ``score``), logged as
    ``reward/<name>`` means; every scored call must return the same names (every rank sums
    them; a failed call has none and adds 0)."""
    scored = [m for m in metrics if m]
    names = set(scored[0]) if scored else set()
    if any(set(m) != names for m in scored):
        raise TypeError(
            f"reward.rule={rule} returned different metric names from one call to the next: keep them fixed"
        )
    return {f"reward_extra/{k}": sum(m.get(k, 0.0) for m in metrics) for k in sorted(names)}


def source_sums(prompts, infos: list[dict], rule: torch.Tensor) -> dict[str, float]:
    """Per ``data_source`` reward and correct counts, for every source of the dataset (every rank
    the same keys), when it has more than one; logged as ``reward/<source>`` and
    ``accuracy/<source>``."""
    sources = sorted(set(prompts.sources)) if prompts is not None else []
    if len(sources) < 2:
        return {}
    out = {f"source/{s}/{k}": 0.0 for s in sources for k in ("reward", "correct", "generated")}
    for info, r in zip(infos, rule.tolist()):
        s = info["data_source"]
        out[f"source/{s}/reward"] += r
        out[f"source/{s}/correct"] += float(r > 0.5)
        out[f"source/{s}/generated"] += 1.0
    return out


def last_turn(response: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """The tokens of a multi-turn response's last sampled turn: its last run of mask 1."""
    turns = [(a, b) for a, b, sampled in mask_runs(mask.tolist()) if sampled]
    return response[turns[-1][0] : turns[-1][1]].tolist() if turns else []
