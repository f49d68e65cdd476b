"""How a rank's process ends: without the interpreter finalization gloo can crash in.

A gloo worker thread (``ProcessGroupGloo::runLoop``) drops its reference to a finished
collective's work *after* the caller's ``wait()`` returned. If that releases a tensor's Python
object while the main thread is inside ``Py_FinalizeEx``, the thread cannot take the GIL,
``pthread_exit`` unwinds through a ``noexcept`` frame and the process aborts ("terminate called
without an active exception", SIGABRT; seen in a core dump of ``tools/bench_gather.py``, about one
2-rank FSDP/TP worker exit in ten). ``destroy_process_group`` does not join gloo's threads, and
device meshes keep their groups alive, so no ordering of Python-side cleanup closes the window.
torchrun then reports a finished job as failed and an elastic agent restarts it.

Invariant: after the work returns, the ``atexit`` handlers run (logging, multiprocessing
children, ``weakref.finalize``, among them vLLM's engine shutdown, which destroys its own process
groups and raised "Invalid process group specified" when they were destroyed before it), then
the groups are destroyed, stdio is flushed, and the process
ends with ``os._exit(status)``: exactly what a normal exit does, minus the finalization.

What the exit itself frees need not be freed before it: an object handed to ``keep_until_exit``
in a process that ends here stays referenced until ``os._exit`` and its finalizer never runs.
vLLM's in-process engine shutdown is one: it makes two full collections, the second after
``gc.unfreeze()``, so it walks every imported object, and it leaves the heap unfrozen for the
collection below to walk again (1.5 + 1.0 CPU-s of a 7 CPU-s one-iteration rank forked from a
preload server, py-spy, 2-core AMD EPYC).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

_ENDS_HERE = False
"""True once ``exit_after`` runs this process's work: the process ends through ``os._exit``."""
_KEPT: list[object] = []
"""What ``keep_until_exit`` holds until then."""


def keep_until_exit(owner: object, finalizer) -> bool:
    """In a process that ends through ``exit_after``: detach ``finalizer`` (a ``weakref.finalize``,
    or None when there is none) and hold ``owner`` until ``os._exit``, which frees all the
    finalizer would; returns True. Anywhere else (a test that builds and drops engines in one
    process) nothing changes: False."""
    if not _ENDS_HERE:
        return False
    if finalizer is not None:
        finalizer.detach()
    _KEPT.append(owner)
    return True


def status_of(work: Callable[[], int | None]) -> int:
    """``work()``'s exit status as ``sys.exit`` would give it: its return value (None: 0), a
    ``SystemExit``'s code (a message is printed, status 1), 130 on Ctrl-C, 1 with the
    traceback printed on any other error."""
    try:
        code = work()
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        return 130
    except BaseException:  # noqa: BLE001 - printed as an uncaught error would be, then status 1
        traceback.print_exc()
        return 1
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def exit_after(work: Callable[[], int | None]) -> NoReturn:
    """Run ``work`` and end this process with its status (see the module docstring)."""
    global _ENDS_HERE
    _ENDS_HERE = True
    code = status_of(work)
    gc.collect()  # objects only work's frame held: files closed, engines released
    atexit._run_exitfuncs()  # before the destroy: vLLM's finalizer destroys its own groups, which must still exist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
