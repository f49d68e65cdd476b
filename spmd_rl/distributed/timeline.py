"""Every rank's timeline: the start and end of each stage and of its main parts, always on and
cheap (a span is two clock reads and a tuple in a bounded in-memory buffer). Each rank appends
its iteration's spans to ``<logging.dir>/trace/rank<r>.jsonl`` once per iteration;
``spmd-rl report --trace`` joins the ranks into one Chrome / Perfetto trace (``report.trace``).

Categories: ``stage`` (a stage of the graph, and the iteration's other top-level phases: eval,
prompts, commit, metrics, checkpoint, publish) and ``part`` (inside a stage: residency (memory
moves: gather, swap, sleep), dock_get, dock_put, generate, forward_backward, optimizer).
Times are wall-clock microseconds (``time.time_ns``): comparable across the ranks of one host,
and across hosts as far as their clocks agree.
"""

from __future__ import annotations

import json
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

MAX_SPANS = 100_000
"""Spans kept between flushes; beyond them the oldest are dropped (and counted)."""

_spans: deque = deque(maxlen=MAX_SPANS)
_recorded = 0


def now_us() -> int:
    return time.time_ns() // 1000


@contextmanager
def span(name: str, cat: str = "part"):
    global _recorded
    t0 = now_us()
    try:
        yield
    finally:
        _spans.append((name, cat, t0, now_us()))
        _recorded += 1


def flush(folder: str | Path, rank: int, iteration: int, start_us: int) -> None:
    """Append this iteration's spans (since ``start_us``) as one JSON line; empty the buffer."""
    global _recorded
    end = now_us()
    spans = [list(s) for s in _spans]
    line = {"iteration": iteration, "rank": rank, "start": start_us, "end": end, "dropped": _recorded - len(spans), "spans": spans}
    _spans.clear()
    _recorded = 0
    path = Path(folder) / "trace" / f"rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
