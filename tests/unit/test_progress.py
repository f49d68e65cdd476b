"""Rank 0's progress bar: the current stage (as the stage timer starts it), the iteration count
with the resumed start, the last reward, and one summary line per iteration."""

from __future__ import annotations

import io
import re

from rich.console import Console

from spmd_rl.trainer.metrics import StageTimer
from spmd_rl.trainer.progress import LiveProgress, Quiet, progress_for

METRICS = {
    "reward_mean": 0.625,
    "accuracy": 0.5,
    "response_length_mean": 6.0,
    "loss": 0.1,
    "grad_norm": 1.0,
    "clip_frac": 0.0,
    "entropy": 1.2,
    "logprob_mismatch_mean": 1e-6,
    "iteration_s": 2.0,
    "throughput_eq5": 100.0,
}


def test_bar_follows_stages_and_iterations():
    out = io.StringIO()
    bar = LiveProgress(total=10, start=3, console=Console(file=out, force_terminal=True, width=200))
    timer = StageTimer(bar.stage)
    with timer.stage("generate"):
        assert bar.bar.tasks[0].description == "generate"
    with timer.stage("update"):
        assert bar.bar.tasks[0].description == "update"
    bar.iteration_done(3, METRICS)
    task = bar.bar.tasks[0]
    assert task.completed == 4 and task.total == 10 and task.fields["reward"] == "0.625"
    bar.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # without the terminal's escape codes
    assert "iter 4/10 reward 0.625 acc 0.500" in text and "4/10" in text


def test_logging_progress_picks_the_bar():
    live = progress_for(True, 10, 0)
    assert isinstance(live, LiveProgress)
    live.close()
    assert type(progress_for(False, 10, 0)) is Quiet
    Quiet().iteration_done(0, METRICS)  # no output, no error


def test_the_line_shows_held_out_accuracy_when_the_iteration_evaluated():
    out = io.StringIO()
    bar = LiveProgress(total=2, start=0, console=Console(file=out, force_terminal=False, width=400))
    bar.iteration_done(0, METRICS | {"eval_accuracy": 0.242})
    bar.iteration_done(1, METRICS | {"final_eval_accuracy": 0.31})
    bar.close()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("iter ")]
    assert lines[0].endswith("tok/s/dev | eval 0.242") and lines[1].endswith("tok/s/dev | final eval 0.310"), lines


def test_a_log_line_during_the_bar_gets_a_line_of_its_own(monkeypatch):
    """ "saved checkpoint ..." was written straight to stderr and landed inside the bar's line; while
    the bar is live the root logger's stderr handler prints through the bar's console instead
    (which moves the bar below it), and is restored when the bar closes."""
    import logging
    import sys

    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    root = logging.getLogger()
    plain = logging.StreamHandler(sys.stderr)
    plain.setFormatter(logging.Formatter("[rank0] %(message)s"))
    plain.addFilter(lambda record: "chatter" not in record.getMessage())  # as engines.vllm.logs' terminal filter
    monkeypatch.setattr(root, "handlers", [plain])
    out = io.StringIO()
    bar = LiveProgress(total=10, start=0, console=Console(file=out, force_terminal=True, width=200))
    logging.getLogger("spmd_rl").warning("saved checkpoint /ckpt/iter_000001")
    logging.getLogger("vllm").warning("chatter the terminal filter hides")
    bar.close()
    assert stderr.getvalue() == ""  # nothing went around the bar
    lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "\n", out.getvalue()).splitlines()
    assert "[rank0] saved checkpoint /ckpt/iter_000001" in lines  # the whole line, nothing of the bar in it
    assert "chatter" not in out.getvalue()  # the terminal's filters still act
    assert root.handlers == [plain]
