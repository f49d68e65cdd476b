"""The rollout engine driven from the rank's own thread while the gateway's handlers ask for
samples from theirs.

An in-process engine is not thread-safe (vLLM's engine core is stepped by one caller), and the
ranks of a collective must be the ones that touch it. So the handlers only queue (context,
``SamplingSpec``) with a future; ``EnginePump.run_until`` — on the rank's thread — submits what is
queued, steps the engine while it is busy and resolves each future with the request's samples
as soon as the engine finishes it: requests from every agent share the engine's continuous
batching, whenever they arrive.
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Callable
from concurrent.futures import Future

from spmd_rl.data.sampling import Sample, SamplingSpec


class PhaseClosed(RuntimeError):
    """A request queued after its generation phase ended."""


class EnginePump:
    def __init__(self, engine):
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[Future, list[int], SamplingSpec, object]] = queue.SimpleQueue()
        self.phase: object = None
        """The open phase (``server.Phase``): a request asked for in another is failed, never run."""
        self._waiting: dict[int, Future] = {}
        self._keys = itertools.count()

    def ask(self, context: list[int], spec: SamplingSpec, phase: object) -> Future:
        """Queue a request of ``phase`` (any thread); the future resolves to its ``spec.n`` samples."""
        fut: Future = Future()
        self._inbox.put((fut, context, spec, phase))
        return fut

    def _submit_queued(self, wait_s: float = 0.0) -> None:
        """Submit every queued request; with ``wait_s``, first wait that long for one."""
        while True:
            try:
                fut, context, spec, phase = self._inbox.get(timeout=wait_s) if wait_s else self._inbox.get_nowait()
            except queue.Empty:
                return
            wait_s = 0.0
            if not fut.set_running_or_notify_cancel():
                continue
            if phase is not self.phase:
                fut.set_exception(PhaseClosed("the request's generation phase is over"))
                continue
            key = next(self._keys)
            try:
                self.engine.submit([(key, context)], [spec])
            except Exception as exc:  # noqa: BLE001 - this request's failure, not the rank's
                fut.set_exception(exc)
                continue
            self._waiting[key] = fut

    def run_until(self, finished: Callable[[], bool], idle_wait_s: float = 0.005) -> None:
        """Serve requests until ``finished()`` holds and no request is queued or running."""
        while True:
            self._submit_queued()
            if self.engine.busy():
                for key, samples in self.engine.step():
                    self._resolve(key, samples)
            elif finished() and self._inbox.empty():
                return
            else:
                self._submit_queued(idle_wait_s)

    def drain(self) -> int:
        """Fail every request still queued (its phase closed before it reached the engine: its
        handler answers 503); returns how many."""
        failed = 0
        while True:
            try:
                fut, _, _, _ = self._inbox.get_nowait()
            except queue.Empty:
                return failed
            if fut.set_running_or_notify_cancel():
                fut.set_exception(PhaseClosed("the generation phase closed before this request reached the engine"))
                failed += 1

    def _resolve(self, key: int, samples: list[Sample]) -> None:
        fut = self._waiting.pop(key, None)
        if fut is not None:
            fut.set_result(samples)
