"""The stages of one iteration. Each reads its inputs from the dock in its own layout and
writes its outputs to the dock; only the TP-rank-0 of a DP group writes (its TP peers computed
the same thing). Metric sums are returned by the stage that owns them."""

from __future__ import annotations

import torch

from spmd_rl.algos.core import grpo_advantages, overlong_penalty
from spmd_rl.config.stages import stage_inputs
from spmd_rl.engines.logprobs import SeqBatch, build_batch
from spmd_rl.trainer.context import Run


def _writes(run: Run, layout) -> bool:
    return layout.coords(run.peer.rank)[1] == 0


def _ragged(values: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return [values[k, :n].contiguous().float() for k, n in enumerate(lengths)]


def put_prompts(run: Run, it: int, prompt_positions: list[int], first_group: int = 0) -> None:
    """Generation DP group g writes the prompts of its slice of the round's batch, prompt p
    (global group id q = first_group + p) repeated N times under indices q * N + k."""
    lay, n = run.lay.gen, run.cfg.rollout.n
    g = lay.coords(run.peer.rank)[0]
    per = len(prompt_positions) // lay.dp
    mine = range(g * per, (g + 1) * per)
    if _writes(run, lay):
        ids = [torch.tensor(run.prompts.prompt_ids[prompt_positions[p]], dtype=torch.int32) for p in mine for _ in range(n)]
        answers = [encode_text(run.prompts.answers[prompt_positions[p]]) for p in mine for _ in range(n)]
        run.dock.put("data", it, {"prompt_ids": ids, "answer": answers}, [(first_group + p) * n + k for p in mine for k in range(n)])


def rollout(run: Run, it: int, expected: list[int]) -> dict[str, float]:
    n = run.cfg.rollout.n
    batch = run.dock.get("actor_rollout", it, stage_inputs(run.cfg, "actor_rollout"), run.lay.gen, group_size=n, expected=expected)
    firsts = batch.columns["prompt_ids"][::n]
    idx = batch.indices.tolist()
    seed = run.cfg.trainer.seed * 1_000_003 + it * 10_007 + idx[0] if idx else 0
    samples = run.rollout.generate([p.tolist() for p in firsts], n=n, max_tokens=run.cfg.rollout.max_response_length, seed=seed)
    if _writes(run, run.lay.gen) and idx:
        run.dock.put("actor_rollout", it, {
            "response_ids": [torch.tensor(s.token_ids, dtype=torch.int32) for s in samples],
            "rollout_log_prob": [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples],
            "response_length": torch.tensor([len(s.token_ids) for s in samples], dtype=torch.int32),
        }, idx)
    return {}


def encode_text(text: str) -> torch.Tensor:
    """A string as a dock column value: its UTF-8 bytes."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)


def decode_text(value: torch.Tensor) -> str:
    return value.numpy().tobytes().decode("utf-8")


def reward(run: Run, it: int, expected: list[int]) -> tuple[dict[str, float], torch.Tensor]:
    """Scores of this rank's share. Returns the metric sums and the round's rewards as a dense
    [len(expected)] tensor holding the scores this rank wrote (0 elsewhere), to be summed
    over ranks when every rank needs them (dynamic sampling)."""
    batch = run.dock.get("reward", it, stage_inputs(run.cfg, "reward"), run.lay.train, expected=expected)
    texts = run.tokenizer.batch_decode([r.tolist() for r in batch.columns["response_ids"]], skip_special_tokens=True)
    answers = [decode_text(a) for a in batch.columns["answer"]]  # travelled with the prompt through the dock
    scores = torch.tensor([run.reward_fn(t, a) for t, a in zip(texts, answers)], dtype=torch.float32)
    correct = float((scores > 0.5).sum())
    algo = run.cfg.algorithm
    if algo.name == "dapo" and algo.overlong_buffer:
        lengths = torch.stack(batch.columns["response_length"])
        scores = scores + overlong_penalty(lengths, run.cfg.rollout.max_response_length, algo.overlong_buffer, algo.overlong_penalty)
    if _writes(run, run.lay.train) and len(batch):
        run.dock.put("reward", it, {"reward": scores}, batch.indices)
    own = _writes(run, run.lay.train)
    lengths = torch.stack(batch.columns["response_length"]).float() if len(batch) else torch.zeros(0)
    dense = torch.zeros(len(expected), dtype=torch.float64)
    if own and len(batch):
        slot = {i: k for k, i in enumerate(expected)}
        dense[[slot[i] for i in batch.indices.tolist()]] = scores.double()
    sums = {"reward_sum": float(scores.sum()) * own, "reward_sq": float((scores**2).sum()) * own, "correct": correct * own,
            "generated": len(batch) * own, "response_tokens": float(lengths.sum()) * own,
            "response_max": float(lengths.max()) if len(lengths) else 0.0}
    return sums, dense


def seq_batch(run: Run, batch) -> SeqBatch:
    return build_batch(batch.columns["prompt_ids"], batch.columns["response_ids"], run.tokenizer.pad_token_id)


def logprob_stage(run: Run, it: int, stage: str, engine, column: str, micro: int, expected: list[int]) -> None:
    batch = run.dock.get(stage, it, stage_inputs(run.cfg, stage), run.lay.train, expected=expected)
    if not len(batch):
        return
    lp, _ = engine.logprobs(seq_batch(run, batch), micro)
    if _writes(run, run.lay.train) and len(batch):
        run.dock.put(stage, it, {column: _ragged(lp, [r.numel() for r in batch.columns["response_ids"]])}, batch.indices)


def advantage(run: Run, it: int, expected: list[int]) -> dict[str, float]:
    """GRPO group-normalised advantages of whole prompt groups (group-granular stage), one
    scalar per sample. Counts the trained groups that carry no signal (all advantages 0)."""
    n = run.cfg.rollout.n
    batch = run.dock.get("advantage", it, stage_inputs(run.cfg, "advantage"), run.lay.train, group_size=n, expected=expected)
    if not len(batch):
        return {"adv_zero_groups": 0.0}
    rewards = torch.stack(batch.columns["reward"])
    adv = grpo_advantages(rewards, n, run.cfg.algorithm.norm_adv_by_std)
    own = _writes(run, run.lay.train)
    if own:
        run.dock.put("advantage", it, {"seq_advantage": adv.float()}, batch.indices)
    return {"adv_zero_groups": float((adv.reshape(-1, n) == 0).all(dim=1).sum()) * own}
