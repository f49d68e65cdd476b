"""The stages of one iteration. Each reads its inputs from the dock in its own layout and
writes its outputs to the dock; only the TP-rank-0 of a DP group writes (its TP peers computed
the same thing). Metric sums are returned by the stage that owns them."""

from __future__ import annotations

import torch

from spmd_rl.algos.core import aggregate, constant_reward_groups, grpo_advantages, kl_estimate, overlong_penalty, policy_loss
from spmd_rl.engines.logprobs import SeqBatch, build_batch
from spmd_rl.engines.train import split
from spmd_rl.trainer.context import Run


def _writes(run: Run, layout) -> bool:
    return layout.coords(run.peer.rank)[1] == 0


def _ragged(values: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return [values[k, :n].contiguous().float() for k, n in enumerate(lengths)]


def put_prompts(run: Run, it: int, prompt_positions: list[int]) -> None:
    """Generation DP group g writes the prompts of its slice of the global batch, each
    repeated N times under indices p * N + k."""
    lay, n = run.lay.gen, run.cfg.rollout.n
    g = lay.coords(run.peer.rank)[0]
    per = len(prompt_positions) // lay.dp
    mine = range(g * per, (g + 1) * per)
    if _writes(run, lay):
        ids = [torch.tensor(run.prompts.prompt_ids[prompt_positions[p]], dtype=torch.int32) for p in mine for _ in range(n)]
        run.dock.put("data", it, {"prompt_ids": ids}, [p * n + k for p in mine for k in range(n)])


def rollout(run: Run, it: int) -> dict[str, float]:
    n = run.cfg.rollout.n
    batch = run.dock.get("actor_rollout", it, ["prompt_ids"], run.lay.gen, group_size=n)
    firsts = batch.columns["prompt_ids"][::n]
    idx = batch.indices.tolist()
    seed = run.cfg.trainer.seed * 1_000_003 + it * 10_007 + idx[0] if idx else 0
    samples = run.rollout.generate([p.tolist() for p in firsts], n=n, max_tokens=run.cfg.rollout.max_response_length, seed=seed)
    if _writes(run, run.lay.gen) and idx:
        run.dock.put("actor_rollout", it, {
            "response_ids": [torch.tensor(s.token_ids, dtype=torch.int32) for s in samples],
            "rollout_log_prob": [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples],
            "prompt_length": torch.tensor([p.numel() for p in batch.columns["prompt_ids"]], dtype=torch.int32),
            "response_length": torch.tensor([len(s.token_ids) for s in samples], dtype=torch.int32),
        }, idx)
    return {}


def reward(run: Run, it: int, answers: dict[int, str]) -> dict[str, float]:
    batch = run.dock.get("reward", it, ["response_ids", "response_length"], run.lay.train)
    texts = run.tokenizer.batch_decode([r.tolist() for r in batch.columns["response_ids"]], skip_special_tokens=True)
    n = run.cfg.rollout.n
    scores = torch.tensor([run.reward_fn(t, answers[i // n]) for t, i in zip(texts, batch.indices.tolist())], dtype=torch.float32)
    correct = float((scores > 0.5).sum())
    algo = run.cfg.algorithm
    if algo.name == "dapo" and algo.overlong_buffer:
        lengths = torch.stack(batch.columns["response_length"])
        scores = scores + overlong_penalty(lengths, run.cfg.rollout.max_response_length, algo.overlong_buffer, algo.overlong_penalty)
    if _writes(run, run.lay.train) and len(batch):
        run.dock.put("reward", it, {"reward": scores}, batch.indices)
    own = _writes(run, run.lay.train)
    lengths = torch.stack(batch.columns["response_length"]).float() if len(batch) else torch.zeros(0)
    return {"reward_sum": float(scores.sum()) * own, "reward_sq": float((scores**2).sum()) * own, "correct": correct * own,
            "samples": len(batch) * own, "response_tokens": float(lengths.sum()) * own,
            "response_max": float(lengths.max()) if len(lengths) else 0.0}


def seq_batch(run: Run, batch) -> SeqBatch:
    return build_batch(batch.columns["prompt_ids"], batch.columns["response_ids"], run.tokenizer.pad_token_id)


def logprob_stage(run: Run, it: int, stage: str, engine, column: str, micro: int) -> None:
    batch = run.dock.get(stage, it, ["prompt_ids", "response_ids"], run.lay.train)
    lp, _ = engine.logprobs(seq_batch(run, batch), micro)
    if _writes(run, run.lay.train) and len(batch):
        run.dock.put(stage, it, {column: _ragged(lp, [r.numel() for r in batch.columns["response_ids"]])}, batch.indices)


def advantage(run: Run, it: int) -> dict[str, float]:
    n = run.cfg.rollout.n
    batch = run.dock.get("advantage", it, ["reward", "response_length"], run.lay.train, group_size=n)
    rewards = torch.stack(batch.columns["reward"])
    adv = grpo_advantages(rewards, n, run.cfg.algorithm.norm_adv_by_std)
    dropped = 0.0
    if run.cfg.algorithm.name == "dapo" and run.cfg.algorithm.dynamic_sampling:
        const = constant_reward_groups(rewards, n)
        adv = torch.where(const, torch.zeros_like(adv), adv)
        dropped = float(const.sum())
    lengths = [int(x) for x in batch.columns["response_length"]]
    if _writes(run, run.lay.train) and len(batch):
        run.dock.put("advantage", it, {"advantages": [torch.full((L,), float(a)) for a, L in zip(adv.tolist(), lengths)]}, batch.indices)
    return {"dropped_samples": dropped * _writes(run, run.lay.train)}


def update(run: Run, it: int, use_ref: bool, use_old: bool) -> dict[str, float]:
    """PPO epochs over mini-batches of this rank's share; one optimizer step per mini-batch."""
    cfg = run.cfg
    cols = ["prompt_ids", "response_ids", "advantages"] + (["ref_log_prob"] if use_ref else []) + (["old_log_prob"] if use_old else [])
    batch = run.dock.get("actor_update", it, cols, run.lay.train)
    seqs = seq_batch(run, batch)
    width = seqs.mask.shape[1]

    def padded(name: str) -> torch.Tensor:
        out = torch.zeros(len(batch), width)
        for k, v in enumerate(batch.columns[name]):
            out[k, : v.numel()] = v
        return out

    adv = padded("advantages")
    ref = padded("ref_log_prob") if use_ref else None
    old = padded("old_log_prob") if use_old else None
    per_rank_mini = cfg.actor.mini_batch_size * cfg.rollout.n // run.lay.train.dp
    stats = {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "kl": 0.0, "entropy": 0.0, "steps": 0, "lr": 0.0}
    for _ in range(cfg.actor.ppo_epochs):
        for start in range(0, len(batch), per_rank_mini):
            sl = slice(start, start + per_rank_mini)
            mini = seqs[sl]
            tokens = float(mini.mask.sum())
            micro = cfg.actor.micro_batch_size
            parts = {"adv": adv[sl], "ref": ref[sl] if ref is not None else None, "old": old[sl] if old is not None else None}
            acc = {"clip": 0.0, "kl": 0.0, "ent": 0.0}

            def loss_fn(lp, ent, k, parts=parts, mini=mini, tokens=tokens, acc=acc):
                s = slice(k * micro, (k + 1) * micro)
                mask = mini.mask[s].to(lp.device)
                a = parts["adv"][s].to(lp.device)
                old_lp = parts["old"][s].to(lp.device) if parts["old"] is not None else lp.detach()
                denom = tokens if cfg.actor.loss_agg_mode == "token-mean" else None
                loss, clip = policy_loss(lp, old_lp, a, mask, cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high,
                                         cfg.actor.clip_ratio_c, cfg.actor.loss_agg_mode, denom)
                w = float(mask.sum()) / max(tokens, 1.0)
                if cfg.actor.loss_agg_mode != "token-mean":
                    loss = loss * w
                if parts["ref"] is not None:
                    kl = kl_estimate(lp, parts["ref"][s].to(lp.device), cfg.algorithm.kl_estimator)
                    kl_loss = aggregate(kl, mask, "token-mean", tokens)
                    acc["kl"] += float(kl_loss.detach())
                    if cfg.algorithm.use_kl_loss:
                        loss = loss + cfg.algorithm.kl_coef * kl_loss
                ent_mean = aggregate(ent, mask, "token-mean", tokens)
                acc["ent"] += float(ent_mean.detach())
                if cfg.actor.entropy_coef:
                    loss = loss - cfg.actor.entropy_coef * ent_mean
                acc["clip"] += float(clip) * w
                return loss

            out = run.actor.train_step(split(mini, micro), loss_fn, with_entropy=True)
            stats["loss"] += out["loss"]
            stats["grad_norm"] += out["grad_norm"]
            stats["lr"] = out["lr"]
            stats["clip_frac"] += acc["clip"]
            stats["kl"] += acc["kl"]
            stats["entropy"] += acc["ent"]
            stats["steps"] += 1
    steps = max(1, stats.pop("steps"))
    return {k: (v / steps if k != "lr" else v) for k, v in stats.items()}
