"""The python environment's jail (``envs.jail``, ``envs.sandbox``) against the escapes an outside
review made from model-written code on a root CI machine, each observed from outside the jail:
the job token in a rank's environment, the host's files and ``/dev/shm``, the calling rank's
process, children that outlive the call, a fork bomb, the host's network namespace, a
path-bound UNIX socket, and the calls a seccomp filter refuses."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from spmd_rl.envs.jail import CallCgroup, cgroup_place, jail_problem
from spmd_rl.envs.sandbox import Limits, Outcome, run_python
from spmd_rl.envs.seccomp import DENIED, NUMBERS, program
from tests.conftest import REPO, subprocess_env
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
    """Each call here succeeds in the jail without the filter (a user namespace of its own needs
    no capability, and in it ``mount`` and ``setns`` are allowed; checked with an allow-all
    program in the filter's place), so EPERM is the filter's: ``unshare(CLONE_NEWNET)``,
    ``mount`` or ``setns`` alone would be refused for want of a capability, filter or not.
    ``ptrace`` comes last: a traced bootstrap loses its output."""
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
os.mkdir('scratch')  # every call below is harmless where it succeeds (a broken jail must not hurt the host):
def clone_newuser():  # a child in a user namespace of its own, which ends at once
    rc = libc.syscall(%d, 0x10000000 | 17, None, None, None, None)
    if rc == 0:
        os._exit(0)
    if rc > 0:
        os.waitpid(rc, 0)
    return min(rc, 0)
calls = {'bpf': lambda: libc.syscall(%d, 0, None, 0),
         # CLONE_NEWNS | CLONE_FS: the kernel refuses the pair (EINVAL), the filter first (EPERM)
         'clone_newns': lambda: libc.syscall(%d, 0x00020000 | 0x00000200 | 17, None, None, None, None),
         'clone_newuser': clone_newuser,
         'unshare': lambda: libc.unshare(0x10000000 | 0x00020000 | 0x40000000),  # CLONE_NEWUSER | NEWNS | NEWNET
         'mount': lambda: libc.mount(b'none', b'scratch', b'tmpfs', 0, None),
         'setns': lambda: libc.setns(os.open('/proc/self/ns/net', os.O_RDONLY), 0x40000000),
         'ptrace': lambda: libc.ptrace(0, 0, None, None)}
for name, call in calls.items():
    ctypes.set_errno(0)
    rc = call()
    print(name, rc, ctypes.get_errno(), flush=True)
""" % (NUMBERS[os.uname().machine]["clone"], NUMBERS[os.uname().machine]["bpf"], NUMBERS[os.uname().machine]["clone"])
    out = run_python(code)
    assert out.ok, out
    for name in ("bpf", "clone_newns", "clone_newuser", "unshare", "mount", "setns", "ptrace"):
        assert f"{name} -1 1\n" in out.output, out.output  # EPERM from the filter


FILTER_ALONE = r"""
import ctypes, os, sys
from spmd_rl.envs.seccomp import program
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x10000000 | 0x00020000 | 0x40000000) == 0, ctypes.get_errno()  # user, mount, network: its own
assert libc.mount(b'none', b'/', None, 0x4000 | 0x40000, None) == 0  # MS_REC | MS_PRIVATE: nothing leaves it
if sys.argv[2] == 'filter':
    prog = ctypes.create_string_buffer(program(), len(program()))
    class Fprog(ctypes.Structure):
        _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_void_p)]
    fprog = Fprog(len(prog) // 8, ctypes.addressof(prog))
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, MODE_FILTER
for name, call in {'unshare': lambda: libc.unshare(0x40000000),
                   'mount': lambda: libc.mount(b'none', sys.argv[1].encode(), b'tmpfs', 0, None),
                   'setns': lambda: libc.setns(os.open('/proc/self/ns/net', os.O_RDONLY), 0x40000000)}.items():
    ctypes.set_errno(0)
    print(name, call(), ctypes.get_errno())
"""


def test_the_filter_alone_refuses_mount_setns_and_unshare_that_would_succeed(tmp_path):
    """In the jail ``mount`` and ``setns`` fail for want of a capability whenever the filter
    refuses the namespace first: here a process holds every capability over namespaces of its
    own, where the three calls succeed, before it loads the filter, after which each is EPERM."""
    for mode, expected in (("none", "0 0"), ("filter", "-1 1")):
        target = tmp_path / mode
        target.mkdir()
        res = subprocess.run(
            [sys.executable, "-c", FILTER_ALONE, str(target), mode],
            capture_output=True,
            text=True,
            timeout=60,
            env=subprocess_env(),
        )
        assert res.returncode == 0, res.stderr
        for name in ("unshare", "mount", "setns"):
            assert f"{name} {expected}\n" in res.stdout, (mode, res.stdout)


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


# --- the per-call limits, as this process's user and as an ordinary one (issue 67, finding 8) ---

USERS = ("this user", "uid 4242", "uid 4242, delegated cgroup")
_AS_OTHER = """
import dataclasses, json, sys
from spmd_rl.envs.jail import cgroup_place
from spmd_rl.envs.sandbox import Limits, run_python
job = json.load(sys.stdin)
out = run_python(job['code'], Limits(**job['limits']))
place, line = cgroup_place()
print(json.dumps({'outcome': dataclasses.asdict(out), 'cgroup': [place is not None, line]}))
"""


@functools.cache
def _as_4242() -> tuple[list[str], str]:
    """(setpriv ... PYTHON running as uid 4242, '') or ([], why not). The interpreter must be one
    that uid can run and whose prefix it can read (the jail mounts it): this one's, else the
    system's (``spmd_rl.envs`` needs nothing beyond the standard library)."""
    if os.geteuid() != 0:
        return [], "this process is not root: the variant as this user is the ordinary user's"
    if (setpriv := shutil.which("setpriv")) is None:
        return [], "setpriv (util-linux) is missing: the jail cannot be run as uid 4242 here"
    drop = [setpriv, "--reuid", "4242", "--regid", "4242", "--clear-groups"]
    probe = (
        "import os, sys; sys.exit(not all(os.access(p, os.R_OK | os.X_OK) for p in (sys.executable, sys.base_prefix)))"
    )
    for exe in (sys.executable, "/usr/bin/python3"):
        if os.path.exists(exe) and subprocess.run([*drop, exe, "-I", "-S", "-c", probe], cwd="/").returncode == 0:
            return [*drop, exe], ""
    return [], "no Python here that uid 4242 can run"


def _drop(user: str) -> list[str]:
    """The command prefix that runs a program as ``user`` (skips the test where none can be had)."""
    if user == "this user":
        return []
    argv, why = _as_4242()
    if not argv:
        pytest.skip(why)
    return argv[:-1]


@contextlib.contextmanager
def _delegated_cgroup():
    """A cgroup uid 4242 owns and runs in, as a site delegates one: cgroup v1's memory and pids
    (a v2 subtree, with its leaf and controllers, is not made here)."""
    place, line = cgroup_place()
    if place is None or place[0] != 1:
        pytest.skip(f"no cgroup v1 to delegate here: {line}")
    cg = CallCgroup(*place, 2**34, 4096)
    try:
        for d in cg.dirs:
            for name in [d, *(os.path.join(d, f) for f in os.listdir(d))]:
                os.chown(name, 4242, 4242)
        yield cg
    finally:
        cg.close()


def _run_as(user: str, code: str, **limits) -> tuple[Outcome, bool, str]:
    """``run_python(code, Limits(**limits))`` as ``user``, and whether that user can make a
    cgroup per call here (``jail.cgroup_place``) with the line saying which or why not."""
    if user == "this user":
        place, line = cgroup_place()
        return run_python(code, Limits(**limits)), place is not None, line
    argv, why = _as_4242()
    if not argv:
        pytest.skip(why)
    with _delegated_cgroup() if user.endswith("delegated cgroup") else contextlib.nullcontext() as cg:
        cmd = [*argv, "-c", _AS_OTHER]
        res = subprocess.run(
            cg.wrap(cmd) if cg is not None else cmd,
            input=json.dumps({"code": code, "limits": limits}),
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    return Outcome(**got["outcome"]), *got["cgroup"]


@pytest.mark.parametrize("user", USERS)
def test_a_call_forks_its_processes_and_no_more_however_many_tasks_its_user_runs(user):
    """RLIMIT_NPROC was the caller's host-wide task count + ``processes``, but a jail's user
    namespace counts from 0: with 40 other tasks of the user, ``processes=16`` let 55 forks
    through. Now, with 60 other tasks of the calling user running, exactly 16 (the call's cgroup
    and the limit counted inside both stop the 17th)."""
    others = [subprocess.Popen([*_drop(user), "/bin/sleep", "27.5"]) for _ in range(60)]
    marker = f"28.{time.time_ns() % 10**9}"  # ends by itself, should the jail be broken
    code = f"""
import os
made = 0
try:
    for _ in range(120):
        if os.fork() == 0:
            os.execv('/bin/sleep', ['sleep', '{marker}'])
        made += 1
except OSError as exc:
    print('fork refused', type(exc).__name__)
print('forked', made)
"""
    try:
        out, _, _ = _run_as(user, code, processes=16, wall_s=20)
    finally:
        for p in others:
            p.kill()
            p.wait()
    assert out.ok and "fork refused BlockingIOError" in out.output, out
    assert int(re.search(r"forked (\d+)", out.output).group(1)) == 16, out.output
    assert _alive_with(marker) == []


MEMORY = """
import os
go_r, go_w = os.pipe()
children = []
for _ in range(8):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        block = b'\\x01' * (64 << 20)  # touched: every page written
        os.write(w, b'1')
        os.read(go_r, 1)  # held until the parent lets go
        os._exit(0)
    os.close(w)
    children.append((pid, r))
reported = [pid for pid, r in children if os.read(r, 1) == b'1']  # b'': it died first
os.close(go_w)
ended = {pid: os.waitpid(pid, 0)[1] for pid, _ in children}
print('together', sum(ended[pid] == 0 for pid in reported), 'of', len(reported))
"""


@pytest.mark.parametrize("user", USERS)
def test_a_calls_processes_together_hold_no_more_than_its_memory(user):
    """Memory was limited per process only (RLIMIT_AS): 8 processes held 2.4 GiB in one call.
    Eight children each touch 64 MiB and hold it until the parent lets all go: those that exit
    0 held theirs together, which must stay under the call's 256 MiB (or the call is killed),
    where a cgroup can be made (else see the doctor's warning and docs/operations.md)."""
    out, has_cgroup, line = _run_as(user, MEMORY, memory_bytes=256 * 2**20, wall_s=20)
    if not has_cgroup:
        pytest.skip(f"{user}: {line}")
    assert out.status in ("ok", "killed"), out
    if out.ok:  # the OOM killer picks the largest process: a child
        together = int(re.search(r"together (\d+) of", out.output).group(1))
        assert 1 <= together and together * 64 < 256, out.output


@pytest.mark.parametrize("user", USERS)
def test_dev_and_the_root_are_read_only_and_dev_shm_is_sized(user):
    """bubblewrap's ``/dev`` and root were tmpfs of the jail's user, sized at half of the host's
    memory (128 MiB written to each); ``/dev/shm`` now takes ``file_bytes`` and no more."""
    code = """
import errno, os
for d in ('/', '/dev'):
    try:
        open(os.path.join(d, 'x'), 'wb').close()
        print(d, 'written')
    except OSError as exc:
        print(d, errno.errorcode[exc.errno])
n = 0
try:
    for i in range(16):  # 1 MiB files: each under the file size limit, together past the tmpfs's size
        with open('/dev/shm/%d' % i, 'wb') as f:
            f.write(b'\\x01' * 2**20)
        n += 1
except OSError as exc:
    print('shm', n, errno.errorcode[exc.errno])
"""
    out, _, _ = _run_as(user, code, file_bytes=4 * 2**20)
    assert out.ok, out
    assert "/ EROFS\n" in out.output and "/dev EROFS\n" in out.output, out.output
    assert "shm 4 ENOSPC\n" in out.output, out.output  # usable up to its size, not past it


def test_doctor_says_which_limits_a_tool_call_gets_here(monkeypatch):
    """One line: ok where a cgroup per call can be made, a warning naming the sum of the
    per-process limits where none can (and not a failure)."""
    from spmd_rl.config.loader import load_config
    from spmd_rl.envs import jail
    from spmd_rl.launcher import doctor

    cfg = load_config(REPO / "configs" / "quickstart_tools.yaml", ["rollout.environment=python"])
    place, line = cgroup_place()
    check = doctor.tool_jail(cfg)
    assert check.ok and check.warn == (place is None) and line in check.detail, check.line()
    monkeypatch.setattr(jail, "cgroup_place", lambda: (None, "no cgroup can be made: refused"))
    check = doctor.tool_jail(cfg)
    assert check.line().startswith("warn  tool jail: no cgroup can be made: refused;"), check.line()
    assert "a call up to 32 x 512 MiB" in check.detail, check.line()
