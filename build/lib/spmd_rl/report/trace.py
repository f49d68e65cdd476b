"""One Chrome / Perfetto trace of every rank's timeline (``distributed.timeline``): the JSON object
format of the Trace Event Format, which ui.perfetto.dev and chrome://tracing open.

- one process ("spmd-rl run"), one thread (track) per rank, named "rank r" and sorted by rank
  (``M`` metadata events ``thread_name`` / ``thread_sort_index``);
- each iteration of each rank a complete event (``ph: "X"``) "iteration i" spanning it, and
  each recorded span a complete event inside it (category ``stage`` or ``part``), so the
  viewer nests parts under stages under iterations;
- ``ts`` / ``dur`` in microseconds from the first event of the run.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_timelines(folder: Path) -> dict[int, list[dict]]:
    """rank -> its iteration lines (a line cut by a kill is skipped)."""
    out: dict[int, list[dict]] = {}
    for path in sorted(folder.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            out.setdefault(int(row["rank"]), []).append(row)
    return out


def chrome_trace(timelines: dict[int, list[dict]]) -> dict:
    t0 = min((row["start"] for rows in timelines.values() for row in rows), default=0)
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "spmd-rl run"}}]
    for rank, rows in sorted(timelines.items()):
        events += [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}},
        ]
        for row in rows:
            events.append(
                {
                    "name": f"iteration {row['iteration']}",
                    "cat": "iteration",
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": row["start"] - t0,
                    "dur": row["end"] - row["start"],
                    "args": {"dropped_spans": row.get("dropped", 0)},
                }
            )
            events += [
                {"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": rank, "ts": s - t0, "dur": e - s}
                for name, cat, s, e in row["spans"]
            ]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"clock": "wall, microseconds from the first event"},
    }
