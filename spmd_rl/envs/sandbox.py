"""Model-written code runs here: in a child Python process that limits itself before it runs
the code, so whatever the code does ends as an ``Outcome`` (an observation for the policy),
never as a crash or a hang of the rank that called it.

Limits (``Limits``), applied by the child's bootstrap before the code is read:

- CPU seconds (``RLIMIT_CPU``) and wall seconds (the parent kills the child's process group);
- address space (``RLIMIT_AS``), and no core files;
- output: the parent reads at most ``output_bytes`` of stdout + stderr and kills the child
  once it writes more;
- network: the child moves into a network namespace of its own (``unshare(CLONE_NEWNET)``, with
  a user namespace when not root), where no interface but a down loopback exists; where the
  kernel refuses both, an audit hook refuses every socket connect / bind / send / name lookup
  (Python-level only: ``Outcome.isolation`` says which held).

The parent never unpickles anything from the child: it reads text.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

_BOOT = r"""
import ctypes, os, resource, sys
cpu, mem, net = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
isolation = "network allowed"
if not net:
    libc = ctypes.CDLL(None, use_errno=True)
    NEWNET, NEWUSER = 0x40000000, 0x10000000
    if libc.unshare(NEWNET) == 0:
        isolation = "network namespace"
    elif libc.unshare(NEWUSER | NEWNET) == 0:
        isolation = "user + network namespace"
    else:
        def refuse(event, args):
            if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo"):
                raise PermissionError("network access is disabled in this sandbox")
        sys.addaudithook(refuse)
        isolation = "audit hook"
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
    output_bytes: int = 64 * 2**10
    network: bool = False


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
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOT, str(limits.cpu_s), str(limits.memory_bytes), "1" if limits.network else "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONIOENCODING": "utf-8"})
    chunks: list[bytes] = []
    over = threading.Event()

    def read() -> None:
        got = 0
        while chunk := proc.stdout.read1(65536):
            take = chunk[: max(0, limits.output_bytes + 64 - got)]  # + room for the isolation tag
            chunks.append(take)
            got += len(chunk)
            if got > limits.output_bytes + 64:
                over.set()
                _kill(proc)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.stdin.write(code.encode("utf-8"))
        proc.stdin.close()
    except BrokenPipeError:
        pass
    try:
        proc.wait(timeout=limits.wall_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.wait()
        timed_out = True
    reader.join(timeout=5)
    raw = b"".join(chunks).decode("utf-8", errors="replace")
    isolation, text = _split_tag(raw)
    text = text[: limits.output_bytes]
    code_ = proc.returncode
    status = ("output_limit" if over.is_set() else "timeout" if timed_out else "ok" if code_ == 0
              else "killed" if code_ is not None and code_ < 0 else "error")
    return Outcome(text, status, code_, time.monotonic() - t0, isolation)


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
    return raw[start + 11:end], raw[:start] + raw[end + 1:]
