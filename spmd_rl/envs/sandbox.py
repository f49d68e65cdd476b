"""Model-written code runs here: in a child Python process, inside a jail (``envs.jail``:
bubblewrap with its own namespaces, a read-only system, a private tmpfs, no capabilities and a
seccomp filter), under limits the child sets on itself before it reads the code, so whatever
the code does ends as an ``Outcome`` (an observation for the policy), never as a crash or a
hang of the rank that called it, and nothing of the job is within its reach.

Limits (``Limits``), applied by the child's bootstrap before the code is read:

- CPU seconds (``RLIMIT_CPU``) and wall seconds (the parent kills the jail);
- memory and tasks of the call as a whole, where a cgroup can be made (``jail.CallCgroup``):
  ``memory_bytes`` for all its processes together (its tmpfs pages included, no swap) and
  ``processes`` tasks besides the jail's own;
- every time: address space per process (``RLIMIT_AS``), no core files, file size
  (``RLIMIT_FSIZE``), open files (``RLIMIT_NOFILE``), and ``processes`` tasks besides those it
  starts with (``RLIMIT_NPROC``, set inside: the kernel counts it per user and user namespace,
  so the bootstrap adds what it sees of its own uid there: the jail's few in its user
  namespace, or a root caller's uid of the call's own, ``jail.call_uid``). Where no cgroup can
  be made, the call's memory is bounded only as ``processes`` x ``memory_bytes``;
- output: the parent reads at most ``output_bytes`` of stdout + stderr and kills the child
  once it writes more;
- network: none (the jail's own network namespace) unless ``network`` is set.

Invariant: when ``run_python`` returns, no process the code started is alive. The parent kills
the jail's process group every time, and bubblewrap's PID namespace ends with its first process
(``--die-with-parent``): a forked, ``setsid`` child dies with it.

Where no jail can be had (``jail.jail_problem``), ``Limits.jail=False`` (set from
``rollout.unsafe_python_without_jail``) runs the code as before the jail existed: the limits above
and a network namespace or an audit hook, but the code can read the job's files and token and
signal its rank. ``Outcome.isolation`` says which ran.

The parent never unpickles anything from the child: it reads text.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from spmd_rl.envs.jail import JAIL_TASKS, CallCgroup, call_uid, cgroup_place, jail_problem, jailed_python

log = logging.getLogger("spmd_rl")

_BOOT = r"""
import ctypes, os, resource, sys
cpu, mem, net, nproc, fsize, nofile, drop, jailed = (int(a) for a in sys.argv[1:9])
if drop:  # a root caller's jail: become the call's own uid, for whom RLIMIT_NPROC binds (this clears every capability)
    os.setgroups([])
    os.setresgid(drop, drop, drop)
    os.setresuid(drop, drop, drop)
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
isolation = ("jail" if jailed else "no jail") + (", network allowed" if net else "")
if not jailed and not net:
    libc = ctypes.CDLL(None, use_errno=True)
    NEWNET, NEWUSER = 0x40000000, 0x10000000
    if libc.unshare(NEWNET) == 0:
        isolation = "no jail, network namespace"
    elif libc.unshare(NEWUSER | NEWNET) == 0:
        isolation = "no jail, user + network namespace"
    else:
        def refuse(event, args):
            if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo"):
                raise PermissionError("network access is disabled in this sandbox")
        sys.addaudithook(refuse)
        isolation = "no jail, audit hook"
def tasks():  # of this uid, threads included, as RLIMIT_NPROC counts them: all this process can see
    n = 0
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open('/proc/' + pid + '/status') as f:
                got = dict(line.split(':', 1) for line in f if line.startswith(('Uid:', 'Threads:')))
        except OSError:
            continue
        if int(got['Uid'].split()[0]) == os.getuid():
            n += int(got['Threads'])
    return n
# the kernel counts RLIMIT_NPROC per uid and user namespace: in a new one only this process has it; in the
# jail, the jail's own tasks are all of them (its user namespace, or a root caller's uid of the call's own)
nproc += 1 if isolation == "no jail, user + network namespace" else tasks()
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
sys.stderr.write("\x00isolation=" + isolation + "\x00")
sys.stderr.flush()
code = sys.stdin.read()
sys.stdin.close()
namespace = {"__name__": "__main__"}
exec(compile(code, "<tool>", "exec"), namespace)
"""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20
    """Every process's address space (``RLIMIT_AS``), and where a cgroup can be made the memory of
    all of the call's processes together (module docstring)."""
    output_bytes: int = 64 * 2**10
    network: bool = False
    processes: int = 32
    """Tasks (threads included) the code may start besides the ones the call starts with."""
    file_bytes: int = 16 * 2**20
    """Largest file the code may write (``RLIMIT_FSIZE``); also the size of each of its private
    tmpfs, ``/tmp`` and ``/dev/shm``."""
    open_files: int = 64
    jail: bool = True
    """False: run without the jail (``rollout.unsafe_python_without_jail``; module docstring)."""


@dataclass
class Outcome:
    output: str
    """stdout and stderr as the code wrote them (cut at ``Limits.output_bytes``)."""
    status: str
    """ok, error (non-zero exit), timeout, killed (a signal: CPU or memory limit), output_limit."""
    exit_code: int | None
    seconds: float
    isolation: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(code: str, limits: Limits = Limits()) -> Outcome:
    """Run ``code`` under ``limits`` (module docstring) and return what happened."""
    t0 = time.monotonic()
    cgroup = _cgroup(limits)
    try:
        proc = _start(*_command(limits, cgroup))
        timed_out, over, raw = _communicate(proc, code, limits)
    finally:
        if cgroup is not None and not cgroup.close():
            log.warning("the tool call's cgroup %s could not be removed: a task in it did not exit", cgroup.dirs)
    isolation, text = _split_tag(raw.decode("utf-8", errors="replace"))
    code_ = proc.returncode
    if limits.jail and code_ is not None and code_ > 128 and not timed_out:
        code_ = -(code_ - 128)  # bubblewrap reports a signal as 128 + its number
    status = _status(over, timed_out, code_)
    return Outcome(text[: limits.output_bytes], status, code_, time.monotonic() - t0, isolation)


def _communicate(proc: subprocess.Popen, code: str, limits: Limits) -> tuple[bool, bool, bytes]:
    """Hand ``code`` to the child, wait for it up to the wall time, then kill what is left of it:
    (timed out, output over its limit, the output)."""
    chunks: list[bytes] = []
    over = threading.Event()
    reader = threading.Thread(target=_read, args=(proc, limits.output_bytes + 64, chunks, over), daemon=True)
    reader.start()  # + 64: room for the isolation tag
    try:
        proc.stdin.write(code.encode("utf-8"))
        proc.stdin.close()
    except BrokenPipeError:
        pass
    try:
        proc.wait(timeout=limits.wall_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill(proc)  # every time: whatever the code left running goes with its jail (module docstring)
    proc.wait()
    reader.join(timeout=5)
    return timed_out, over.is_set(), b"".join(chunks)


def _cgroup(limits: Limits) -> CallCgroup | None:
    """The call's cgroup, where one can be made (``jail.cgroup_place``); else None, and the
    limits of each process are all there is."""
    place, _ = cgroup_place()
    if place is None:
        return None
    try:
        return CallCgroup(*place, limits.memory_bytes, limits.processes + (JAIL_TASKS if limits.jail else 1))
    except OSError as exc:
        log.warning("no cgroup for this tool call (%s): its processes are limited one by one", exc)
        return None


def _command(limits: Limits, cgroup: CallCgroup | None) -> tuple[list[str], tuple[int, ...]]:
    """The child's command line (the boot script and its limits, inside the jail unless
    ``limits.jail`` is off, inside ``cgroup`` when there is one) and the descriptors it inherits."""
    drop = call_uid() if limits.jail and os.geteuid() == 0 else 0
    values = (
        limits.cpu_s,
        limits.memory_bytes,
        int(limits.network),
        limits.processes,
        limits.file_bytes,
        limits.open_files,
        drop,
        int(limits.jail),
    )
    boot = [str(v) for v in values]
    wrap = cgroup.wrap if cgroup is not None else list
    if not limits.jail:
        return wrap([sys.executable, "-I", "-S", "-c", _BOOT, *boot]), ()
    if (problem := jail_problem()) is not None:
        raise RuntimeError(
            f"the python environment needs a jail for model-written code: {problem}; "
            "or set rollout.unsafe_python_without_jail: true where none can be had"
        )
    cmd, read = jailed_python(["-c", _BOOT, *boot], limits.file_bytes, limits.network)
    return wrap(cmd), (read,)


def _start(cmd: list[str], fds: tuple[int, ...]) -> subprocess.Popen:
    """The child in a session of its own, with an environment of PATH alone; ``fds`` are closed
    here once it holds them."""
    try:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=fds,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONIOENCODING": "utf-8"},
        )
    finally:
        for fd in fds:
            os.close(fd)


def _read(proc: subprocess.Popen, cap: int, chunks: list[bytes], over: threading.Event) -> None:
    """Collect the child's output up to ``cap`` bytes; past it, set ``over`` and kill the child."""
    got = 0
    while chunk := proc.stdout.read1(65536):
        chunks.append(chunk[: max(0, cap - got)])
        got += len(chunk)
        if got > cap:
            over.set()
            _kill(proc)
            return


def _status(over: bool, timed_out: bool, code: int | None) -> str:
    """``Outcome.status``: output_limit, timeout, ok, killed (a signal) or error, first match."""
    if over:
        return "output_limit"
    if timed_out:
        return "timeout"
    if code == 0:
        return "ok"
    return "killed" if code is not None and code < 0 else "error"


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _split_tag(raw: str) -> tuple[str, str]:
    """(isolation, the rest) from the bootstrap's NUL-delimited tag."""
    start = raw.find("\x00isolation=")
    if start < 0:
        return "unknown", raw
    end = raw.find("\x00", start + 1)
    return raw[start + 11 : end], raw[:start] + raw[end + 1 :]
