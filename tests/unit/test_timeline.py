"""Span times on an accelerator (``distributed.timeline``): the host only queues the work, so a
span ends when the device's timing events say its work did, read once at the flush; on CPU
the host's clock is the span. A fake device stands for the accelerator: its events read a
device clock that the span's body advances by 50 ms while the host returns at once."""

from __future__ import annotations

import json

from spmd_rl.distributed import timeline


class DeviceClock:
    def __init__(self):
        self.ms, self.synced = 0.0, 0

    def event(self):
        clock = self

        class Event:
            def record(self):
                self.at = clock.ms

            def elapsed_time(self, other) -> float:
                return other.at - self.at

            def synchronize(self):
                clock.synced += 1

        return Event()


def _drain(tmp_path) -> None:
    """Flush what earlier tests in this process left in the buffer (an engine's spans)."""
    timeline.flush(tmp_path / "earlier", 0, 0, 0)


def _spans(tmp_path, rank: int) -> list:
    (line,) = (tmp_path / "trace" / f"rank{rank}.jsonl").read_text().splitlines()
    return json.loads(line)["spans"]


def test_a_device_span_ends_when_its_work_does(tmp_path):
    clock = DeviceClock()
    _drain(tmp_path)
    timeline.use_device_events("meta", clock.event)
    try:
        start = timeline.now_us()
        with timeline.span("forward_backward"):
            clock.ms += 50.0  # kernels queued: the device is busy for 50 ms after the host moved on
        assert clock.synced == 0  # no wait inside the step
        timeline.flush(tmp_path, 0, 0, start)
    finally:
        timeline.use_device_events("cpu")
    ((name, cat, t0, t1),) = _spans(tmp_path, 0)
    assert name == "forward_backward" and t1 - t0 == 50_000 and clock.synced == 1


def test_a_cpu_span_is_the_host_clock(tmp_path):
    timeline.use_device_events("cpu")
    _drain(tmp_path)
    start = timeline.now_us()
    with timeline.span("optimizer"):
        pass
    timeline.flush(tmp_path, 1, 0, start)
    ((name, _, t0, t1),) = _spans(tmp_path, 1)
    assert name == "optimizer" and 0 <= t1 - t0 < 50_000


def test_a_recorded_span_ends_when_recorded_and_is_flushed_with_the_iteration(tmp_path):
    """``record``: the checkpoint's span, closed before its commit so the iteration's line is
    written first (``trainer.trainer.Trainer.train``); it spans from the given start to the call."""
    timeline.use_device_events("cpu")
    t0 = timeline.now_us()
    with timeline.span("update", "stage"):
        pass
    timeline.record("checkpoint", "stage", t0)
    after = timeline.now_us()
    timeline.flush(tmp_path, 0, 7, t0)
    line = json.loads((tmp_path / "trace/rank0.jsonl").read_text())
    (name, cat, start, end) = line["spans"][-1]
    assert (line["iteration"], name, cat, start) == (7, "checkpoint", "stage", t0) and start <= end <= after
