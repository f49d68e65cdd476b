"""Per-iteration metrics: global sums over the ranks that own each sample, paper Eq. (5)
throughput, JSONL / TensorBoard logging and a one-line progress print on rank 0."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_rl.distributed import timeline


def throughput(G: int, N: int, PL: int, SL: int, devices: int, seconds: float) -> float:
    """Paper Eq. (5): T = G x N x (PL + SL) / ND / ETE  [tokens / s / device]."""
    return G * N * (PL + SL) / devices / seconds


def global_sums(values: dict[str, float], group) -> dict[str, float]:
    """All-reduce a dict of sums over ``group``, this rank's side (``Run.sides.group``: None,
    the world, colocated); each rank adds only what it owns."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return dict(zip(keys, t.tolist()))


def global_max(value: float, group) -> float:
    """The maximum of ``value`` over ``group`` (``global_sums``)."""
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def global_maxes(values: dict[str, float], group, mins: dict[str, float] | None = None) -> dict[str, float]:
    """All-reduce a dict of values to their maxima over ``group`` (``global_sums``), and ``mins`` to their
    minima (min x = -max(-x)), in one collective. Keys must not repeat between the two."""
    mins = mins or {}
    keys, low = sorted(values), sorted(mins)
    t = torch.tensor([float(values[k]) for k in keys] + [-float(mins[k]) for k in low], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    got = t.tolist()
    return dict(zip(keys, got)) | {k: -v for k, v in zip(low, got[len(keys) :])}


class StageTimer:
    def __init__(self, on_stage: Callable[[str], None] | None = None) -> None:
        """``on_stage(name)`` is called as each stage starts (the progress bar)."""
        self.times: dict[str, float] = {}
        self.on_stage = on_stage

    @contextmanager
    def stage(self, name: str):
        if self.on_stage is not None:
            self.on_stage(name)
        t0 = time.perf_counter()
        with timeline.span(name, "stage"):
            yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


def truncate_from(path: Path, start_iteration: int) -> None:
    """Drop the lines of iterations >= ``start_iteration`` (a resumed run redoes them), so each
    iteration appears once. Written to a temporary file and renamed: never half a file."""
    if not path.is_file():
        return
    keep, torn = [], []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line)["iteration"]) < start_iteration:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            torn.append(line)  # a line cut by a kill: set aside in metrics.jsonl.torn, not lost
    if torn:
        with open(path.with_suffix(".jsonl.torn"), "a") as f:
            f.write("".join(line + "\n" for line in torn))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def wandb_run_id(job: str, lineage: str) -> str | None:
    """``<job>-<lineage>`` in the characters W&B allows in an id (others become ``-``; at most 64)."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", "-".join(p for p in (job, lineage) if p))
    return name[-64:] or None


class MetricsLog:
    """Rank 0 writes ``metrics.jsonl`` (and TensorBoard scalars, and a W&B run, when enabled).
    Lines of iterations at or after ``start_iteration`` (left by a run that was restarted from
    an older checkpoint) are removed first; ``config`` (the validated config, without secrets)
    is written to ``config.json``.

    W&B: one run per checkpoint lineage, id ``<job>-<lineage>`` (``checkpoint.lineage_id``). A
    restart continues its lineage's run and logs the iterations from ``start_iteration`` again;
    W&B keeps both points of a redone iteration (its x-axis is the ``iteration`` metric, not
    W&B's own step, which would drop them). A new run under a reused job name is a new W&B run."""

    def __init__(  # noqa: PLR0913
        self,
        folder: str | Path,
        jsonl: bool,
        tensorboard: bool,
        enabled: bool,
        start_iteration: int = 0,
        wandb=None,
        job: str = "",
        config: dict | None = None,
        lineage: str = "",
    ):
        self.enabled = enabled
        self.folder = Path(folder)
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if enabled and config is not None:  # what `spmd-rl report` shows beside the plots
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        if enabled and wandb is not None:
            import wandb as wandb_lib

            self.folder.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb_lib.init(
                project=wandb.project,
                mode=wandb.mode,
                name=wandb.name or job,
                id=wandb_run_id(job, lineage),
                dir=str(self.folder),
                config=config,
                resume="allow",
            )
            self._wandb.define_metric("iteration")
            self._wandb.define_metric("*", step_metric="iteration")
        if enabled:
            self.folder.mkdir(parents=True, exist_ok=True)
            if jsonl:
                truncate_from(self.folder / "metrics.jsonl", start_iteration)
                self._jsonl = open(self.folder / "metrics.jsonl", "a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.folder / "tb"))

    def write(self, iteration: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._jsonl:
            self._jsonl.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
            self._jsonl.flush()
        if self._tb:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, iteration)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(
                {k: v for k, v in metrics.items() if isinstance(v, (int, float))} | {"iteration": iteration}
            )

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
