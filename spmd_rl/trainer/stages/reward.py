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
    rule = torch.tensor([view.reward_fn(t, a) for t, a in zip(texts, answers)], dtype=torch.float32)
    sums: dict[str, float] = {}
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


def last_turn(response: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """The tokens of a multi-turn response's last sampled turn: its last run of mask 1."""
    turns = [(a, b) for a, b, sampled in mask_runs(mask.tolist()) if sampled]
    return response[turns[-1][0] : turns[-1][1]].tolist() if turns else []
