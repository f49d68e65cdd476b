"""Rank 0's live view of a run (``logging.progress``): a rich progress bar over the iterations
showing the current stage, the ETA and the last iteration's reward, with one summary line per
iteration printed above it. JSONL and TensorBoard metrics are written elsewhere
(``trainer.metrics``); other ranks and ``progress: false`` get :class:`Quiet`."""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class Quiet:
    """The same calls, doing nothing."""

    def stage(self, name: str) -> None:
        pass

    def iteration_done(self, it: int, m: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class LiveProgress(Quiet):
    def __init__(self, total: int, start: int, console: Console | None = None):
        self.total = total
        self.bar = Progress(
            TextColumn("[bold]{task.description:<14}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
        )
        self.task = self.bar.add_task("starting", total=total, completed=start, reward="-")
        self._routed = _route_logging(self.bar.console)  # before start(): the bar then proxies sys.stderr
        self.bar.start()

    def stage(self, name: str) -> None:
        self.bar.update(self.task, description=name)

    def iteration_done(self, it: int, m: dict[str, float]) -> None:
        if m.get("replica_caught_up"):  # an elastic replica that caught up: its peers trained this iteration
            self.bar.console.print(f"[bold]iter {it + 1}/{self.total}[/] trained by the other replicas")
            self.bar.update(self.task, advance=1)
            return
        line = (
            f"[bold]iter {it + 1}/{self.total}[/] reward {m['reward_mean']:.3f} acc {m['accuracy']:.3f} "
            f"len {m['response_length_mean']:.1f} loss {m['loss']:+.4f} gnorm {m['grad_norm']:.3f} clip "
            f"{m['clip_frac']:.3f} "
            f"ent {m['entropy']:.3f} mis {m['logprob_mismatch_mean']:.1e} | {m['iteration_s']:.2f}s T "
            f"{m['throughput_eq5']:.0f} tok/s/dev"
        )
        line += "".join(
            f" | {label} {m[key]:.3f}"
            for key, label in (("eval_accuracy", "eval"), ("final_eval_accuracy", "final eval"))
            if key in m
        )
        self.bar.console.print(line, soft_wrap=True)  # one line, never wrapped (a pipe or a narrow terminal)
        self.bar.update(self.task, advance=1, reward=f"{m['reward_mean']:.3f}", description="iteration done")

    def close(self) -> None:
        root = logging.getLogger()
        for console_handler, handler in self._routed:
            root.removeHandler(console_handler)
            root.addHandler(handler)
        self._routed = []
        self.bar.stop()


class _ConsoleHandler(logging.Handler):
    """A log record printed through the live bar's console: on a line of its own above the bar
    (a record written straight to stderr landed inside the bar's line, "saved checkpoint" among them)."""

    def __init__(self, console: Console, like: logging.Handler):
        super().__init__(like.level)
        self.console = console
        self.setFormatter(like.formatter)
        self.filters = list(like.filters)  # the terminal's own filters (engines.vllm.logs hides vLLM's chatter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(self.format(record), markup=False, highlight=False, soft_wrap=True)
        except Exception:  # noqa: BLE001 - as logging.Handler does
            self.handleError(record)


def _route_logging(console: Console) -> list[tuple[logging.Handler, logging.Handler]]:
    """Swap the root logger's handlers that write to the terminal's stderr for ones that print
    through ``console`` while the bar is live; (new, old) pairs to swap back."""
    root, swapped = logging.getLogger(), []
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (
            sys.stderr,
            sys.__stderr__,
        ):
            routed = _ConsoleHandler(console, handler)
            root.removeHandler(handler)
            root.addHandler(routed)
            swapped.append((routed, handler))
    return swapped


def progress_for(enabled: bool, total: int, start: int) -> Quiet:
    return LiveProgress(total, start) if enabled else Quiet()
