"""The ``spmd-rl`` command line (typer). User errors exit with code 2 and name the field."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import typer

from spmd_rl.config.errors import ConfigError
from spmd_rl.config.loader import load_config
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.recipe.plan import render
from spmd_rl.recipe.rules import check

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="SPMD RL post-training: validate, plan, train, eval."
)

ConfigArg = typer.Argument(..., help="YAML config file.", show_default=False)
OverridesArg = typer.Argument(None, help="Dotted overrides, e.g. actor.optim.lr=1e-5 rollout.n=8.", show_default=False)
WorldOpt = typer.Option(
    None, "--world-size", help="World size to validate for (default: parallel.nnodes x nproc_per_node)."
)
NprocOpt = typer.Option(None, "--nproc-per-node", help="Ranks per node (default: parallel.nproc_per_node).")


def _past_the_imports() -> None:
    """``eval`` and ``export`` import torch, transformers and vLLM (tens of CPU-seconds): with a
    preload server named in ``$SPMD_RL_PRELOAD`` (``launcher.preload``), this process becomes the
    stub of a forked copy that has them; without one, or refused, it goes on by itself. vLLM's
    own log handler stays off in both (``QUIET_ENV``, as the server imported vLLM): its records
    at WARNING and above reach stderr, the INFO chatter does not, and stdout is the result."""
    from spmd_rl.engines.vllm.logs import QUIET_ENV, quiet_vllm
    from spmd_rl.launcher.preload import delegate

    delegate("spmd_rl.cli", sets=QUIET_ENV)
    # this process runs by itself (a preload copy has the server's torch): torch's C++ notes
    # (vLLM CPU's NUMA binding) off the one-line result's terminal unless the user asks for them
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_vllm(None, 0)  # its filter sits on the handler above


def _fail(exc: ConfigError) -> None:
    typer.echo(f"INVALID {exc}", err=True)
    raise typer.Exit(code=exc.exit_code)


def _checked(config: Path, overrides: list[str] | None, world: int | None, nproc: int | None):
    try:
        cfg = load_config(config, overrides or [])
        lay, violations = check(cfg, world, nproc)
        if violations:
            raise ConfigError(violations, str(config))
    except ConfigError as exc:
        _fail(exc)
    return cfg, lay


@app.command()
def validate(
    config: Path = ConfigArg,
    overrides: Optional[list[str]] = OverridesArg,
    world_size: Optional[int] = WorldOpt,
    nproc_per_node: Optional[int] = NprocOpt,
) -> None:
    """Check types and every cross-field rule; print each violation on one line. Exit 0 valid, 2 invalid."""
    cfg, lay = _checked(config, overrides, world_size, nproc_per_node)
    typer.echo(
        f"OK {config}: world {lay.world} ({lay.nnodes} node(s) x {lay.nproc_per_node}), "
        f"train dp_shard={lay.train.dp} tp={lay.train.tp}{f' pp={lay.train.pp}' if lay.train.pp > 1 else ''}, gen "
        f"dp={lay.gen.dp} tp={lay.gen.tp}, "
        f"{cfg.algorithm.name} G={cfg.data.global_batch_size} N={cfg.rollout.n}"
    )


@app.command()
def plan(
    config: Path = ConfigArg,
    overrides: Optional[list[str]] = OverridesArg,
    world_size: Optional[int] = WorldOpt,
    nproc_per_node: Optional[int] = NprocOpt,
    bandwidth_gbps: float = typer.Option(
        0.29296875,
        "--bandwidth-gbps",
        help="Inter-node link bandwidth in GB/s (1 GB = 1024^3 B); default 300 MB/s as in the paper.",
    ),
) -> None:
    """Print both layouts rank by rank, per-rank memory, redundant memory R (Eq. 3) and TCV (Eqs. 2, 4)."""
    if bandwidth_gbps <= 0:
        typer.echo("INVALID --bandwidth-gbps must be > 0", err=True)
        raise typer.Exit(code=2)
    cfg, lay = _checked(config, overrides, world_size, nproc_per_node)
    typer.echo(render(cfg, ModelArch.from_folder(cfg.model.path), lay, bandwidth_gbps))


@app.command()
def doctor(
    config: Path = ConfigArg,
    overrides: Optional[list[str]] = OverridesArg,
) -> None:
    """Check this node for the config: package versions, devices, etcd, dock ports, host memory and
    /dev/shm. One line per check; exit 0 when none failed, 2 with each fix otherwise."""
    from spmd_rl.launcher.doctor import diagnose

    cfg, lay = _checked(config, overrides, None, None)
    checks = diagnose(cfg, lay, ModelArch.from_folder(cfg.model.path))
    for c in checks:
        typer.echo(c.line())
    failed = [c.name for c in checks if not c.ok]
    typer.echo(
        f"{len(checks) - len(failed)} of {len(checks)} checks passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    if failed:
        raise typer.Exit(code=2)


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="A run's logging folder (logging.dir, holding metrics.jsonl)."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Where the PNGs and report.html go; default RUN_DIR/report."
    ),
    trace: bool = typer.Option(
        False,
        "--trace",
        help="Also write trace.json: every rank's stage timeline as one Chrome/Perfetto trace (open it in "
        "ui.perfetto.dev).",
    ),
) -> None:
    """PNG plots of a run's metrics (reward, accuracy, lengths, KL, entropy, clip fraction, mismatch,
    grad norm, time and memory per stage) and one self-contained HTML page with them and the config."""
    import json

    from rich.progress import Progress

    from spmd_rl.report.page import render as render_page
    from spmd_rl.report.plots import draw, read_rows

    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        typer.echo(
            f"INVALID {run_dir}: no metrics.jsonl there -> pass the run's logging.dir (e.g. runs/quickstart/logs)",
            err=True,
        )
        raise typer.Exit(code=2)
    out = out or run_dir / "report"
    with Progress(transient=True) as bar:
        task = bar.add_task(f"reading {metrics}", total=metrics.stat().st_size)
        rows = read_rows(metrics, lambda n: bar.advance(task, n))
    drawn, empty = draw(rows, out)
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else None
    page = out / "report.html"
    page.write_text(render_page(f"spmd-rl run {run_dir}", drawn, empty, config, len(rows)))
    made = {"html": str(page), "figures": [str(p) for _, p in drawn], "no_data": [f.name for f in empty]}
    if trace:
        from spmd_rl.report.trace import chrome_trace, read_timelines

        timelines = read_timelines(run_dir / "trace")
        if not timelines:
            typer.echo(
                f"INVALID {run_dir}/trace: no rank timelines there (every run writes them from this version on)",
                err=True,
            )
            raise typer.Exit(code=2)
        (out / "trace.json").write_text(json.dumps(chrome_trace(timelines)))
        made["trace"] = str(out / "trace.json")
    typer.echo(json.dumps(made))


@app.command()
def train(
    config: Path = ConfigArg,
    overrides: Optional[list[str]] = OverridesArg,
    nproc_per_node: Optional[int] = NprocOpt,
) -> None:
    """Train on this node: validate, start the embedded etcd if no endpoints are configured,
    run torchrun with `python -m spmd_rl.train`. Exit code is torchrun's (2: invalid config)."""
    from spmd_rl.launcher.local import run_local

    nproc = nproc_per_node or 0
    cfg, lay = _checked(config, overrides, None if not nproc else nproc, nproc or None)
    raise typer.Exit(code=run_local(config, list(overrides or []), cfg, lay.nproc_per_node))


@app.command()
def export(
    checkpoint_dir: Path = typer.Argument(..., help="A checkpoint folder (iter_NNNNNN)."),
    out: Path = typer.Option(..., "--out", help="Output HF folder."),
    merged: bool = typer.Option(
        False,
        "--merged",
        help="LoRA checkpoint: write the base model with the adapters merged instead of the adapter folder.",
    ),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="float32, bfloat16 or float16; default: the run's model.dtype."
    ),
    max_shard_gb: float = typer.Option(5.0, "--max-shard-gb", help="Largest safetensors file, in GB (10^9 bytes)."),
) -> None:
    """Write a checkpoint's actor as a Hugging Face folder (safetensors + tokenizer); a LoRA
    checkpoint as a PEFT adapter folder, or with --merged as the merged model."""
    _past_the_imports()
    from spmd_rl.trainer.export import DTYPES, export as export_ckpt, is_checkpoint

    if not is_checkpoint(checkpoint_dir):
        typer.echo(f"INVALID {checkpoint_dir}: not a complete checkpoint (no trainer_state.json)", err=True)
        raise typer.Exit(code=2)
    try:
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"--dtype={dtype}: not one of {', '.join(DTYPES)}")
        typer.echo(f"wrote {export_ckpt(checkpoint_dir, out, merged, dtype, int(max_shard_gb * 10**9))}")
    except ValueError as exc:  # BadCheckpoint is one; so is a checkpoint of another model
        typer.echo(f"INVALID {exc}", err=True)
        raise typer.Exit(code=2) from None


@app.command(name="eval")
def evaluate(  # noqa: PLR0913
    model: Path = typer.Argument(..., help="HF model folder or checkpoint folder."),
    overrides: Optional[list[str]] = typer.Argument(None, help="key=value overrides of the evaluation's config."),
    config: Optional[Path] = typer.Option(
        None, "--config", help="The run's config: its data fields, chat template, reward and eval section apply."
    ),
    data: Optional[Path] = typer.Option(None, "--data", help="A prompt file to evaluate instead of data.test_path."),
    rule: Optional[str] = typer.Option(None, "--rule", help="Reward rule deciding correctness (reward.rule)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Evaluate only the first N prompts of each set."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Response length limit (eval.max_tokens)."),
    n: Optional[int] = typer.Option(None, "--n", help="Sampled answers per prompt (eval.n): mean@n, pass@k, maj@n."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="eval.temperature of sampled answers."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="eval.top_p of sampled answers."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="The engine's dtype (model.dtype)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks of the engine (vLLM's own workers)."),
    environment: Optional[str] = typer.Option(
        None, "--environment", help="Multi-turn: a registered environment or module:function (as rollout.environment)."
    ),
    max_turns: Optional[int] = typer.Option(None, "--max-turns", help="With --environment: rollout.max_turns."),
    pairs: bool = typer.Option(
        False,
        "--pairs",
        help="--data is a preference file (prompt, chosen, rejected): print DPO's held-out margin and accuracy against "
        "--reference instead.",
    ),
    reference: Optional[Path] = typer.Option(
        None, "--reference", help="With --pairs: the reference HF folder; default: a checkpoint's base model."
    ),
    engine: Optional[str] = typer.Option(None, "--engine", help="The rollout engine that generates (rollout.engine)."),
) -> None:
    """Held-out scores through a rollout engine (in-process vLLM by default) with the run's config
    (--config, or the one a checkpoint records): greedy accuracy and, with eval.n, mean@n, pass@k
    and maj@n per set and data_source. With --pairs the preference margin of the model against
    its reference (HF forwards). Prints one JSON line."""
    _past_the_imports()
    import json
    import tempfile

    _files_exist(data, config)
    given = {"data.test_path": data, "reward.rule": rule, "eval.limit": limit, "eval.max_tokens": max_tokens}
    given |= {"eval.n": n, "eval.temperature": temperature, "eval.top_p": top_p, "model.dtype": dtype}
    given |= {"rollout.environment": environment, "rollout.max_turns": max_turns, "rollout.engine": engine}
    asked = _as_overrides(given) + list(overrides or [])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _hf_folder(model, Path(tmp))
        if pairs:
            from spmd_rl.trainer.pair_eval import preference_eval

            if data is None:
                typer.echo("INVALID --pairs needs --data (a preference file)", err=True)
                raise typer.Exit(code=2)
            result = preference_eval(model_dir, _pairs_reference(model, reference), data, limit)
        else:
            result = _offline_scores(model, model_dir, config, asked, tp)
    typer.echo(json.dumps(result | {"model": str(model)}))


def _files_exist(*paths: Path | None) -> None:
    for given in paths:
        if given is not None and not given.is_file():
            typer.echo(f"INVALID {given}: file not found", err=True)
            raise typer.Exit(code=2)


def _as_overrides(options: dict) -> list[str]:
    """The options given, as the overrides they stand for."""
    return [f"{k}={v}" for k, v in options.items() if v is not None]


def _offline_scores(model: Path, model_dir: Path, config: Path | None, overrides: list[str], tp: int) -> dict:
    """``eval``'s scores (``trainer.offline_eval``); exit 2 on a bad config or option."""
    from spmd_rl.trainer.checkpoint import read_state
    from spmd_rl.trainer.export import is_checkpoint
    from spmd_rl.trainer.offline_eval import evaluate_offline, offline_config

    recorded = read_state(model).get("config") if is_checkpoint(model) else None
    if is_checkpoint(model):
        overrides = [*overrides, "model.tokenizer_path=null"]  # the exported folder holds the tokenizer
    try:
        cfg = offline_config(config, recorded, model_dir, overrides)
        if not cfg.data.test_path:
            raise ValueError("nothing to evaluate: give --data, or a config whose data.test_path names the sets")
        return evaluate_offline(cfg, tp)
    except ConfigError as exc:
        _fail(exc)
    except ValueError as exc:  # also a row that does not fit (data.rows.BadRow), --tp past the cores
        typer.echo(f"INVALID {exc}", err=True)
        raise typer.Exit(code=2) from None


def _hf_folder(model: Path, tmp: Path) -> Path:
    """``model`` itself when it is an HF folder; a checkpoint exported (merged) under ``tmp``;
    else exit 2 naming it."""
    from spmd_rl.engines.training.safe_dcp import BadCheckpoint
    from spmd_rl.trainer.export import export as export_ckpt, is_checkpoint

    if is_checkpoint(model):
        try:
            return export_ckpt(model, tmp / "hf", merged=True)
        except BadCheckpoint as exc:
            typer.echo(f"INVALID {exc}", err=True)
            raise typer.Exit(code=2) from None
    if (model / "config.json").is_file():
        return model
    typer.echo(f"INVALID {model}: neither an HF model folder nor a checkpoint", err=True)
    raise typer.Exit(code=2)


def _pairs_reference(model: Path, reference: Path | None) -> Path:
    """The reference of ``eval --pairs``: ``--reference``, else the base model a checkpoint names;
    exit 2 when neither is an HF folder."""
    from spmd_rl.trainer.checkpoint import read_state
    from spmd_rl.trainer.export import is_checkpoint

    ref = reference or (Path(read_state(model)["model_path"]) if is_checkpoint(model) else None)
    if ref is None or not (ref / "config.json").is_file():
        typer.echo(
            f"INVALID --reference={ref}: --pairs needs the reference HF folder (a checkpoint names its base model)",
            err=True,
        )
        raise typer.Exit(code=2)
    return ref


@app.command(name="config-reference")
def config_reference() -> None:
    """Print the configuration reference (every field, type, default, range, description) as
    Markdown; docs/config.md is this output."""
    from spmd_rl.config.reference import render

    typer.echo(render(), nl=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
