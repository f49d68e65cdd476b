"""The python environment's jail (``envs.jail``, ``envs.sandbox``) against the escapes an outside
review made from model-written code on a root CI machine, each observed from outside the jail:
the job token in a rank's environment, the host's files and ``/dev/shm``, the calling rank's
process, children that outlive the call, a fork bomb, the host's network namespace, a
path-bound UNIX socket, and the calls a seccomp filter refuses."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from spmd_rl.envs.jail import jail_problem
from spmd_rl.envs.sandbox import Limits, run_python
from spmd_rl.envs.seccomp import DENIED, NUMBERS, program
from tests.unit.test_sandbox import reached


def test_a_jail_can_be_had_here():
    """launch/setup.sh installs bubblewrap; every test below needs it."""
    assert jail_problem() is None


def _alive_with(marker: str) -> list[int]:
    """Host processes whose command line holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.fixture
def rank():
    """A stand-in for the rank that calls the tool: a process holding the job token."""
    token = f"job-token-{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], env={**os.environ, "SPMD_RL_JOB_TOKEN": token}
    )
    yield proc, token
    proc.kill()
    proc.wait()


def test_the_job_token_and_other_processes_are_out_of_reach(rank, monkeypatch):
    proc, token = rank
    monkeypatch.setenv("SPMD_RL_JOB_TOKEN", token)  # in the caller's own environment too
    code = f"""
import os
pids = [p for p in os.listdir('/proc') if p.isdigit()]
seen = []
for p in pids:
    for f in ('environ', 'cmdline'):
        try:
            seen.append(open(f'/proc/{{p}}/{{f}}', 'rb').read())
        except OSError:
            pass
print('pids', len(pids), 'found', any({token.encode()!r} in s for s in seen), 'env', {token!r} in str(os.environ))
try:
    os.kill({proc.pid}, 9)
    print('killed')
except OSError as exc:
    print('kill refused', type(exc).__name__)
"""
    out = run_python(code)
    assert out.ok, out
    assert "found False env False" in out.output, out.output
    assert int(re.search(r"pids (\d+)", out.output).group(1)) <= 3, out.output  # the jail's own few
    time.sleep(0.2)
    assert proc.poll() is None, "the code killed the rank"


def test_files_of_the_host_are_out_of_reach(tmp_path):
    ckpt = tmp_path / "ckpt.bin"
    ckpt.write_bytes(b"weights")
    marker = f"escape-{uuid.uuid4().hex}"
    shm = Path("/dev/shm") / f"spmd-rl-test-{marker}"
    shm.write_bytes(b"segment")
    try:
        code = f"""
import os
for path, mode in (({str(ckpt)!r}, 'wb'), ('/tmp/{marker}', 'w'), ({str(Path.home() / marker)!r}, 'w')):
    try:
        open(path, mode).write('x')
        print('wrote', path)
    except OSError as exc:
        print('refused', path, type(exc).__name__)
try:
    print('shm', open({str(shm)!r}, 'rb').read())
except OSError as exc:
    print('shm refused', type(exc).__name__, os.listdir('/dev/shm'))
open('/tmp/scratch', 'w').write('a private tmpfs is writable')
print('scratch ok')
"""
        out = run_python(code)
        assert out.ok and "scratch ok" in out.output, out
        assert ckpt.read_bytes() == b"weights"
        assert not (Path("/tmp") / marker).exists() and not (Path.home() / marker).exists()
        assert (
            f"wrote /tmp/{marker}" in out.output
        )  # into its own private /tmp, which the host's check above did not see
        assert "shm refused FileNotFoundError []" in out.output, out.output
    finally:
        shm.unlink()
        for path in (Path("/tmp") / marker, Path.home() / marker):  # should the jail be broken
            path.unlink(missing_ok=True)


def test_no_process_of_the_code_outlives_the_call():
    """A forked, setsid child that would sleep on, and a fork bomb: the process limit stops the
    bomb, and nothing is left once run_python returns, though the code itself returned at once."""
    marker = f"29.{time.time_ns() % 10**9}"  # a sleep that ends by itself within 30 s, should the jail be broken
    code = f"""
import os
if os.fork() == 0:
    os.setsid()
    os.execv('/bin/sleep', ['sleep', '{marker}'])
made = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            os.execv('/bin/sleep', ['sleep', '{marker}'])
        made += 1
except OSError as exc:
    print('fork refused after', made, type(exc).__name__)
print('forked', made)
"""
    out = run_python(code, Limits(processes=16))
    assert out.ok, out
    made = int(re.search(r"forked (\d+)", out.output).group(1))
    assert made < 16 and "fork refused" in out.output, out.output
    time.sleep(0.5)
    assert _alive_with(marker) == []


def test_the_host_network_namespace_and_unix_sockets_are_out_of_reach(tmp_path):
    path = str(tmp_path / "rank.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    server.settimeout(0.5)
    code = f"""
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
try:  # the jail's own first process: the host's are not visible
    print('setns', libc.setns(os.open('/proc/1/ns/net', os.O_RDONLY), 0), ctypes.get_errno())
except OSError as exc:
    print('first process ns refused', type(exc).__name__)
print('setns', libc.setns(os.open('/proc/self/ns/net', os.O_RDONLY), 0), ctypes.get_errno())
s = socket.socket(socket.AF_UNIX)
try:
    s.connect({path!r})
    print('unix connected')
except OSError as exc:
    print('unix refused', type(exc).__name__)
"""
    out = run_python(code)
    assert not reached(server) and out.ok, out
    assert "setns -1 1" in out.output and "unix refused FileNotFoundError" in out.output, out.output


def test_the_seccomp_filter_refuses_namespaces_mounts_tracing_and_bpf():
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
os.mkdir('scratch')  # every call below is harmless where it succeeds (a broken jail must not hurt the host):
calls = {'unshare': lambda: libc.unshare(0x40000000),
         'mount': lambda: libc.mount(b'none', b'scratch', b'tmpfs', 0, None),
         'ptrace': lambda: libc.ptrace(0, 0, None, None), 'bpf': lambda: libc.syscall(%d, 0, None, 0),
         # CLONE_NEWNS | CLONE_FS: the kernel refuses the pair (EINVAL), the filter first (EPERM)
         'clone_newns': lambda: libc.syscall(%d, 0x00020000 | 0x00000200 | 17, None, None, None, None)}
for name, call in calls.items():
    rc = call()
    print(name, rc, ctypes.get_errno())
""" % (NUMBERS[os.uname().machine]["bpf"], NUMBERS[os.uname().machine]["clone"])
    out = run_python(code)
    assert out.ok, out
    for name in ("unshare", "mount", "ptrace", "bpf", "clone_newns"):
        assert f"{name} -1 1\n" in out.output, out.output  # EPERM from the filter


def test_the_filter_numbers_are_the_kernel_headers():
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if not header.exists():
        pytest.skip("no x86_64 kernel headers here")
    defined = dict(re.findall(r"#define __NR_(\w+) (\d+)", header.read_text()))
    for name, nr in NUMBERS["x86_64"].items():
        assert int(defined[name]) == nr, name
    assert (
        set(DENIED) <= set(NUMBERS["aarch64"]) and len(program("x86_64")) % 8 == 0 and len(program("aarch64")) % 8 == 0
    )


def test_without_the_jail_the_code_runs_as_before_and_says_so():
    out = run_python("print('ok')", Limits(jail=False))
    assert out.ok and out.isolation.startswith("no jail"), out


def test_a_killed_jail_reports_the_signal():
    out = run_python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert out.status == "killed" and out.exit_code == -signal.SIGSEGV, out
