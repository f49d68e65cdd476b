"""The report's figures, one PNG each, drawn with matplotlib's Agg backend from the rows of
``metrics.jsonl``. A figure is drawn when at least one of its metrics is in the rows; the ones
with none are listed, not failed (a run without a reference has no KL)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Figure:
    name: str
    title: str
    metrics: tuple[str, ...]
    ylabel: str = ""
    stacked: bool = False
    """Stacked areas of every metric with the prefix in ``metrics[0]`` (per-stage time, memory)."""


FIGURES = (
    Figure("reward", "Reward", ("reward_mean",), "mean reward"),
    Figure("accuracy", "Accuracy (training samples and held-out greedy)", ("accuracy", "eval_accuracy"), "fraction correct"),
    Figure("response_length", "Response length", ("response_length_mean", "response_length_max"), "tokens"),
    Figure("kl", "KL to the reference", ("kl", "kl_reward"), "nats per token"),
    Figure("entropy", "Entropy", ("entropy",), "nats per token"),
    Figure("clip_fraction", "Clip fraction", ("clip_frac",), "fraction of tokens"),
    Figure("logprob_mismatch", "Trainer vs rollout log-prob mismatch", ("logprob_mismatch_mean", "logprob_mismatch_max"), "|log p difference|"),
    Figure("grad_norm", "Gradient norm", ("grad_norm",), "global L2 norm"),
    Figure("stage_time", "Time per stage", ("time_",), "seconds", stacked=True),
    Figure("stage_memory", "Resident memory per stage (largest rank)", ("mem_",), "GiB", stacked=True),
)


def read_rows(path: Path, progress: Callable[[int], None] | None = None) -> list[dict]:
    """The rows of ``metrics.jsonl``; a line cut by a kill is skipped. ``progress(bytes)`` is
    called as the file is read."""
    rows = []
    with open(path, "rb") as f:
        for line in f:
            if progress is not None:
                progress(len(line))
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def series(rows: Iterable[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        if isinstance(r.get(key), (int, float)):
            xs.append(int(r.get("iteration", len(xs))))
            ys.append(float(r[key]))
    return xs, ys


def _stacked_keys(rows: list[dict], prefix: str) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith(prefix)})


def draw(rows: list[dict], out: Path) -> tuple[list[tuple[Figure, Path]], list[Figure]]:
    """(the figures drawn and their PNGs, the figures with no data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    drawn, empty = [], []
    for fig in FIGURES:
        keys = _stacked_keys(rows, fig.metrics[0]) if fig.stacked else [k for k in fig.metrics if series(rows, k)[0]]
        if not keys:
            empty.append(fig)
            continue
        f, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        if fig.stacked:
            its = sorted({int(r["iteration"]) for r in rows if "iteration" in r})
            scale = 2**-30 if fig.name == "stage_memory" else 1.0
            by_it = {int(r["iteration"]): r for r in rows if "iteration" in r}
            values = [[float(by_it[i].get(k, 0.0)) * scale for i in its] for k in keys]
            labels = [k.removeprefix(fig.metrics[0]).removesuffix("_bytes") for k in keys]
            if fig.name == "stage_memory":  # resident bytes at each stage's entry: one line each (they are not additive)
                for v, label in zip(values, labels):
                    ax.plot(its, v, label=label)
            else:
                ax.stackplot(its, values, labels=labels)
            ax.legend(fontsize=7, loc="upper left", ncol=2)
        else:
            for k in keys:
                xs, ys = series(rows, k)
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=k)
            if len(keys) > 1:
                ax.legend(fontsize=8)
        ax.set_title(fig.title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(fig.ylabel)
        ax.grid(alpha=0.3)
        f.tight_layout()
        path = out / f"{fig.name}.png"
        f.savefig(path)
        plt.close(f)
        drawn.append((fig, path))
    return drawn, empty
