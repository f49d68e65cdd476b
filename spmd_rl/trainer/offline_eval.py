"""``spmd-rl eval``: held-out evaluation of an HF folder or a checkpoint in one process, with the
run's own data fields, chat template, reward and ``eval`` section (``trainer.evaluate``'s
``Evaluation``), so an offline score means what the run's own evaluation means.

The config comes from ``--config``, else from the checkpoint (which records the run's config,
``dock.token`` left out), else from the command's options alone (the layout of
``assets/tiny-qwen2/test.jsonl``: ``prompt`` and ``answer`` columns, ``exact_match``). The
command's options are overrides on top of it (``offline_overrides``).
"""

from __future__ import annotations

from pathlib import Path

from spmd_rl.config.loader import apply_overrides, build_config, load_config
from spmd_rl.config.schema import Config


def recorded_config(cfg: Config) -> dict:
    """What a checkpoint records of its run's config: everything but the dock's secret."""
    tree = cfg.model_dump(mode="json")
    tree["dock"]["token"] = None
    return tree


def offline_config(config: Path | None, recorded: dict | None, model_dir: Path, overrides: list[str]) -> Config:
    """The evaluation's config (module docstring) with ``overrides`` applied and the engine
    pointed at ``model_dir`` (a checkpoint's weights exported there). ConfigError names a bad
    field."""
    bare = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "data": {"train_path": "unused.jsonl", "global_batch_size": 1, "max_prompt_length": 4096},
        "rollout": {"n": 1, "max_response_length": 8},
        "actor": {"mini_batch_size": 1, "micro_batch_size": 1},
        "trainer": {"iterations": 1, "device": "auto"},
    }
    overrides = [*overrides, f"model.path={model_dir}"]
    if config is not None:
        return load_config(config, overrides)
    return build_config(apply_overrides(recorded or bare, overrides), "the checkpoint's config" if recorded else "eval")


def evaluate_offline(cfg: Config, tp: int) -> dict:
    """Every set of ``data.test_path`` scored as the run scores it (``trainer.evaluate``); the
    first set's greedy results also as ``prompts``, ``correct`` and ``accuracy``."""
    from spmd_rl.data.prompts import load_tokenizer
    from spmd_rl.envs.factory import environment_factory
    from spmd_rl.envs.multi_turn import MultiTurnRollout, TurnLimits
    from spmd_rl.recipe.graph import Modes
    from spmd_rl.trainer.evaluate import GREEDY, Evaluation, held_out_for

    tok, r = load_tokenizer(cfg), cfg.rollout
    held_out = held_out_for(cfg, tok)
    max_tokens = cfg.eval.max_tokens or r.max_response_length
    rollout = _engine(cfg, tp, max_tokens)
    turns = None
    if Modes.of(cfg).multi_turn:
        env = environment_factory(r.environment, r.unsafe_python_without_jail)
        turns = MultiTurnRollout(rollout, tok, env, TurnLimits(r.max_turns, max_tokens, r.tool_timeout_s))
    ev = Evaluation.of_config(cfg, held_out, rollout, tok, turns)
    out: dict = {}
    for name, test in held_out.sets.items():
        count = ev.count(test)
        table = ev.table(test, list(range(count)), count)
        out |= ev.scores(name, test, table, "eval")
        if "prompts" not in out and cfg.eval.greedy:
            correct = int(table[:, GREEDY].sum())
            out |= {"data": name, "prompts": count, "correct": correct, "accuracy": correct / max(count, 1)}
    return out


def _engine(cfg: Config, tp: int, max_tokens: int):
    """The rollout engine of ``rollout.engine`` in this process, with ``tp`` workers of its own."""
    from spmd_rl.distributed.accelerator import detect
    from spmd_rl.engines.base import RolloutBuild
    from spmd_rl.engines.rollouts import build_rollout_engine

    acc = detect(cfg.trainer.device)
    if acc.kind == "cpu" and tp > 1:
        bind_cpu_workers(tp)
    build = RolloutBuild(
        cfg.model.path,
        acc,
        cfg.rollout,
        tp=tp,
        dtype=cfg.model.dtype,
        max_model_len=_context(cfg, max_tokens),
        seed=cfg.trainer.seed,
        distributed=False,
    )
    return build_rollout_engine(build)


def _context(cfg: Config, max_tokens: int) -> int:
    """The engine's context: the longest prompt plus answer the config allows, within the model's positions."""
    from spmd_rl.config.model_arch import ModelArch

    wanted = cfg.data.max_prompt_length + max(max_tokens, cfg.rollout.max_response_length)
    return min(wanted, ModelArch.from_folder(cfg.model.path).max_positions or wanted)


def bind_cpu_workers(tp: int) -> None:
    """vLLM CPU's ``tp`` worker processes each bind their OpenMP threads to a NUMA node and refuse
    more workers than nodes; unless ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise, give each an
    equal share of this process's CPUs instead ("0|1" on two cores). ValueError with fewer CPUs
    than workers."""
    import os

    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise ValueError(f"--tp {tp}: vLLM CPU runs one worker per core at least; this process has {len(cpus)} CPUs")
    per = len(cpus) // tp
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(map(str, cpus[k * per : (k + 1) * per])) for k in range(tp)
    )
