"""``teardown.exit_after``: a rank's process ends with its work's status, after the process
group was destroyed, the ``atexit`` handlers ran and stdio was flushed, without the interpreter
finalization in which gloo's worker threads can abort the process (see the module docstring).
``status_of`` maps what the work did to the status ``sys.exit`` would give."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO


def _raise(exc: BaseException):
    def work():
        raise exc

    return work


@pytest.mark.parametrize(
    "work, status, printed",
    [
        (lambda: None, 0, ""),
        (lambda: 0, 0, ""),
        (lambda: 2, 2, ""),
        (_raise(SystemExit(2)), 2, ""),
        (_raise(SystemExit(None)), 0, ""),
        (_raise(SystemExit("bad config")), 1, "bad config"),
        (_raise(KeyboardInterrupt()), 130, ""),
        (_raise(ValueError("boom")), 1, "ValueError: boom"),
    ],
)
def test_status_is_what_sys_exit_would_give(work, status, printed, capsys):
    from spmd_rl.distributed.teardown import status_of

    assert status_of(work) == status
    err = capsys.readouterr().err
    assert printed in err and (err == "") == (printed == "")


_SCRIPT = textwrap.dedent("""
    import atexit, gc, sys, weakref
    import torch.distributed as dist
    from spmd_rl.distributed.teardown import exit_after

    out = sys.argv[1]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    refs = []
    real = dist.destroy_process_group

    def destroy():
        with open(out + ".destroy", "w") as f:
            f.write(str(all(r() is None for r in refs)))  # the work's objects were collected first
        real()

    dist.destroy_process_group = destroy
    atexit.register(lambda: open(out + ".atexit", "w").write("ran"))

    class Holder:  # in a reference cycle, as meshes and DTensors are: only a collection frees it
        def __init__(self):
            self.me = self

    def work():
        gc.disable()
        h = Holder()
        refs.append(weakref.ref(h))
        dist.all_reduce(__import__("torch").ones(1))
        sys.stdout.write("unflushed output")  # no newline, block-buffered into a pipe
        return int(sys.argv[2]) if sys.argv[2] != "raise" else 1 // 0

    exit_after(work)
    open(out + ".returned", "w").write("exit_after returned")
""")


@pytest.mark.parametrize("arg, status", [("3", 3), ("raise", 1)])
def test_exit_after_ends_the_process_cleanly(tmp_path, arg, status):
    out = tmp_path / "r"
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(out), arg],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == status, done.stderr
    assert done.stdout == "unflushed output"
    assert (out.parent / "r.destroy").read_text() == "True"
    assert (out.parent / "r.atexit").read_text() == "ran"
    assert not (out.parent / "r.returned").exists()
    assert ("ZeroDivisionError" in done.stderr) == (arg == "raise")


_MP_TARGETS = {"tools/bench_weight_stream.py"}
"""Scripts whose process groups live in ``multiprocessing`` children: those end through
multiprocessing's own exit, which flushes their result queues."""


def test_every_script_that_joins_a_process_group_ends_through_exit_after():
    """Each torchrun entry point (the trainer, the tools' and test helpers' workers) that
    initialises a process group ends its ``__main__`` block through ``exit_after``."""
    scripts = [
        REPO / "spmd_rl/train.py",
        *sorted((REPO / "tools").glob("*.py")),
        *sorted((REPO / "tests/helpers").glob("*.py")),
    ]
    joiners = [p for p in scripts if "init_process_group(" in p.read_text()]
    assert len(joiners) >= 8  # the scan still finds the workers
    missing = []
    for p in joiners:
        rel = str(p.relative_to(REPO))
        main_block = p.read_text().partition('if __name__ == "__main__":')[2]
        if rel not in _MP_TARGETS and "exit_after(" not in main_block:
            missing.append(rel)
    assert not missing, f"end these through spmd_rl.distributed.teardown.exit_after: {missing}"


_KEEP_SCRIPT = textwrap.dedent("""
    import sys, weakref
    from spmd_rl.distributed import teardown

    out = sys.argv[1]

    class Engine:
        pass

    def shutdown(tag):
        open(out + "." + tag, "w").write("ran")

    def build(tag):
        engine = Engine()
        return engine, teardown.keep_until_exit(engine, weakref.finalize(engine, shutdown, tag))

    engine, kept = build("outside")  # no exit_after yet: nothing changes
    open(out + ".kept_outside", "w").write(str(kept))
    del engine  # its finalizer runs now

    def work():
        engine, kept = build("inside")
        open(out + ".kept_inside", "w").write(str(kept))
        return 0  # the frame drops the engine: kept, its finalizer detached

    teardown.exit_after(work)
""")


def test_what_a_process_ending_through_exit_after_keeps_is_never_finalized(tmp_path):
    out = tmp_path / "k"
    done = subprocess.run(
        [sys.executable, "-c", _KEEP_SCRIPT, str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "k.kept_outside").read_text() == "False"
    assert (tmp_path / "k.outside").read_text() == "ran"  # dropped outside: finalized as before
    assert (tmp_path / "k.kept_inside").read_text() == "True"
    assert not (tmp_path / "k.inside").exists()  # not on the drop, the collection or atexit
