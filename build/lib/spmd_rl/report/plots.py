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
    Figure(
        "accuracy", "Accuracy (training samples and held-out greedy)", ("accuracy", "eval_accuracy"), "fraction correct"
    ),
    Figure("response_length", "Response length", ("response_length_mean", "response_length_max"), "tokens"),
    Figure("kl", "KL to the reference", ("kl", "kl_reward"), "nats per token"),
    Figure("entropy", "Entropy", ("entropy",), "nats per token"),
    Figure("clip_fraction", "Clip fraction", ("clip_frac",), "fraction of tokens"),
    Figure(
        "logprob_mismatch",
        "Trainer vs rollout log-prob mismatch",
        ("logprob_mismatch_mean", "logprob_mismatch_max"),
        "|log p difference|",
    ),
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


SMOOTHING = 0.9
"""The weight ``w`` of :func:`smoothed`, drawn over a series of at least ``SMOOTH_FROM`` points
(its effective window is about 1 / (1 - w) = 10 iterations)."""
SMOOTH_FROM = 20
WARMUP_FACTOR = 3.0
"""An iteration whose stage times add up to more than this many times the median iteration's
is a warm-up (engine builds, first compilation): drawn in its own panel."""


def smoothed(ys: list[float], weight: float = SMOOTHING) -> list[float]:
    """TensorBoard's debiased exponential moving average:
    ``s_t = (1 - w) * sum_{k<=t} w^(t-k) * y_k / (1 - w^(t+1))``, computed as the running
    ``m_t = w * m_{t-1} + (1 - w) * y_t`` (``m_{-1} = 0``) divided by ``1 - w^(t+1)``."""
    out, m = [], 0.0
    for t, y in enumerate(ys):
        m = weight * m + (1 - weight) * y
        out.append(m / (1 - weight ** (t + 1)))
    return out


def warmup_iterations(rows: list[dict], prefix: str = "time_") -> list[int]:
    """The iterations whose summed ``prefix`` times exceed ``WARMUP_FACTOR`` x the median (see there)."""
    totals = {
        int(r["iteration"]): sum(float(v) for k, v in r.items() if k.startswith(prefix))
        for r in rows
        if "iteration" in r
    }
    if len(totals) < 3:
        return []
    ordered = sorted(totals.values())
    median = ordered[len(ordered) // 2]
    return sorted(i for i, t in totals.items() if t > WARMUP_FACTOR * median)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def figure(fig: Figure, rows: list[dict]):
    """The matplotlib figure of ``fig`` (None without data). A line series of ``SMOOTH_FROM``
    points or more is drawn faint with its :func:`smoothed` line over it; the stage-time
    stack puts its :func:`warmup_iterations` in a narrow panel of their own, so the steady
    iterations keep their scale."""
    plt = _pyplot()
    keys = _stacked_keys(rows, fig.metrics[0]) if fig.stacked else [k for k in fig.metrics if series(rows, k)[0]]
    if not keys:
        return None
    warm = warmup_iterations(rows) if fig.name == "stage_time" else []
    if warm:
        f, (ax_warm, ax) = plt.subplots(1, 2, figsize=(7, 3.6), dpi=100, gridspec_kw={"width_ratios": [1, 5]})
    else:
        f, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    if fig.stacked:
        by_it = {int(r["iteration"]): r for r in rows if "iteration" in r}
        its = sorted(set(by_it) - set(warm))
        scale = 2**-30 if fig.name == "stage_memory" else 1.0
        labels = [k.removeprefix(fig.metrics[0]).removesuffix("_bytes") for k in keys]
        values = [[float(by_it[i].get(k, 0.0)) * scale for i in its] for k in keys]
        if fig.name == "stage_memory":  # resident bytes at each stage's entry: one line each (they are not additive)
            for v, label in zip(values, labels):
                ax.plot(its, v, label=label)
        else:
            ax.stackplot(its, values, labels=labels)
        if warm:
            bottom = [0.0] * len(warm)
            for k in keys:
                height = [float(by_it[i].get(k, 0.0)) for i in warm]
                ax_warm.bar([str(i) for i in warm], height, bottom=bottom)
                bottom = [b + h for b, h in zip(bottom, height)]
            ax_warm.set_title("warm-up", fontsize=9)
            ax_warm.set_xlabel("iteration")
            ax_warm.set_ylabel(fig.ylabel)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    else:
        for k in keys:
            xs, ys = series(rows, k)
            if len(xs) >= SMOOTH_FROM:
                (raw,) = ax.plot(xs, ys, alpha=0.25, linewidth=0.8)
                ax.plot(xs, smoothed(ys), color=raw.get_color(), label=f"{k} (smoothed)")
            else:
                ax.plot(xs, ys, marker="o", markersize=3, label=k)
        if len(keys) > 1 or len(series(rows, keys[0])[0]) >= SMOOTH_FROM:
            ax.legend(fontsize=8)
    ax.set_title(fig.title + (" (steady iterations)" if warm else ""))
    ax.set_xlabel("iteration")
    ax.set_ylabel("" if warm else fig.ylabel)
    ax.grid(alpha=0.3)
    f.tight_layout()
    return f


def draw(rows: list[dict], out: Path) -> tuple[list[tuple[Figure, Path]], list[Figure]]:
    """(the figures drawn and their PNGs, the figures with no data)."""
    plt = _pyplot()

    out.mkdir(parents=True, exist_ok=True)
    drawn, empty = [], []
    for fig in FIGURES:
        f = figure(fig, rows)
        if f is None:
            empty.append(fig)
            continue
        path = out / f"{fig.name}.png"
        f.savefig(path)
        plt.close(f)
        drawn.append((fig, path))
    return drawn, empty
