"""Every rank's timeline: the start and end of each stage and of its main parts, always on and
cheap (a span is two clock reads and a tuple in a bounded in-memory buffer). Each rank appends
its iteration's spans to ``<logging.dir>/trace/rank<r>.jsonl`` once per iteration;
``spmd-rl report --trace`` joins the ranks into one Chrome / Perfetto trace (``report.trace``).

Categories: ``stage`` (a stage of the graph, and the iteration's other top-level phases: eval,
prompts, commit, metrics, checkpoint, publish) and ``part`` (inside a stage: residency (memory
moves: gather, swap, sleep), dock_get, dock_put, generate, forward_backward, optimizer).
Times are wall-clock microseconds (``time.time_ns``): comparable across the ranks of one host,
and across hosts as far as their clocks agree.

On an accelerator the host only queues kernels, so a span's host end marks when its launches
were queued, not when they ran. With ``use_device_events(device)`` every span also records a
timing event of the device at its start and end (no synchronisation there); ``flush`` waits for
them once per iteration and ends each span at ``max(host end, start + device time between its
events)``, where the device time is what the events measured.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MAX_SPANS = 100_000
"""Spans kept between flushes; beyond them the oldest are dropped (and counted)."""

_spans: deque = deque(maxlen=MAX_SPANS)
_recorded = 0
_new_event: Callable[[], Any] | None = None
"""Makes a recorded timing event of the training device (``use_device_events``); None on CPU."""


def now_us() -> int:
    return time.time_ns() // 1000


def use_device_events(device, new_event: Callable[[], Any] | None = None) -> None:
    """Time the spans with ``device``'s (a ``torch.device``) timing events (module docstring);
    none on CPU, where the host runs the work itself. ``new_event``: an event maker other than
    ``torch.Event``."""
    global _new_event
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        _new_event = None
        return

    make = new_event or (lambda: torch.Event(device=device, enable_timing=True))

    def recorded():
        event = make()
        event.record()
        return event

    _new_event = recorded


@contextmanager
def span(name: str, cat: str = "part"):
    global _recorded
    t0, e0 = now_us(), _new_event() if _new_event else None
    try:
        yield
    finally:
        _spans.append((name, cat, t0, now_us(), e0, _new_event() if e0 is not None else None))
        _recorded += 1


def record(name: str, cat: str, start_us: int) -> None:
    """A span from ``start_us`` to now, for a part whose end is not the end of a block (a
    checkpoint's span closes before its commit, ``trainer.trainer.Trainer.train``)."""
    global _recorded
    _spans.append((name, cat, start_us, now_us(), None, None))
    _recorded += 1


def _ended(s: tuple) -> list:
    """[name, cat, start, end] with the device's end where the span has events."""
    name, cat, t0, t1, e0, e1 = s
    if e0 is not None:
        e1.synchronize()
        t1 = max(t1, t0 + round(e0.elapsed_time(e1) * 1000))  # elapsed_time: milliseconds
    return [name, cat, t0, t1]


def flush(folder: str | Path, rank: int, iteration: int, start_us: int) -> None:
    """Append this iteration's spans (since ``start_us``) as one JSON line; empty the buffer."""
    global _recorded
    end = now_us()
    spans = [_ended(s) for s in _spans]
    line = {
        "iteration": iteration,
        "rank": rank,
        "start": start_us,
        "end": end,
        "dropped": _recorded - len(spans),
        "spans": spans,
    }
    _spans.clear()
    _recorded = 0
    path = Path(folder) / "trace" / f"rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
