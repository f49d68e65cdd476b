"""The jail model-written code runs in (the ``python`` environment, ``envs.sandbox``):
bubblewrap, the unprivileged sandbox Flatpak uses (Debian's ``bubblewrap``, installed by
``launch/setup.sh``).

Why bubblewrap and not nsjail: it is one small setuid-free binary in every distribution's
archive (nsjail is built from source with protobuf), it sets ``no_new_privs`` always, drops every
capability, takes a seccomp program as a file descriptor, and ``--die-with-parent`` plus its PID
namespace take every process of the jail along when it ends. What the jail gives the child:

- its own PID, mount, IPC, UTS, cgroup and network namespaces (no interface but its own loopback;
  and a user namespace when the caller is not root), and a fresh ``/proc`` in which no process of
  the host is visible;
- a read-only view of the system's programs and libraries and of Python's own prefix, and
  nothing else of the host: no home, no job directory, no checkpoints, no ``/dev/shm`` (a private
  empty one), a private tmpfs of ``tmp_bytes`` as its working directory;
- no capabilities, ``no_new_privs``, the seccomp filter of ``envs.seccomp``;
- an empty environment but ``PATH`` and the encoding (no job token, no API key).

Resource limits (CPU, memory, processes, file size, open files) are set by the bootstrap inside
(``envs.sandbox``). A process limit binds only a non-root user, so a root caller's jail runs the
code as ``nobody`` (65534).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

NOBODY = 65534
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
LOADER_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def python_for_jail() -> tuple[str, str]:
    """(the real interpreter file, the prefix it needs): a venv's ``python`` is a link into its
    base prefix, which is what the jail mounts (the child runs with ``-I -S``: no site-packages)."""
    exe = os.path.realpath(sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


def bwrap_args(bwrap: str, seccomp_fd: int, tmp_bytes: int, network: bool, as_nobody: bool) -> list[str]:
    """The bubblewrap command line up to (not including) the program it runs (module docstring)."""
    args = [
        bwrap,
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
    ]
    if not network:
        args.append("--unshare-net")
    if (
        as_nobody
    ):  # root: no user namespace (nobody must be a real uid for the process limit); the bootstrap drops to it
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # an unprivileged caller: its own user namespace, where it is nobody
        args += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    exe, prefix = python_for_jail()
    bound: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
            bound.append(d)
    if not any(prefix == d or prefix.startswith(d + "/") for d in bound):
        parents = _ancestors(prefix)  # passable to nobody, whatever the host's modes (/root is 0700)
        args += [a for p in parents for a in ("--perms", "0755", "--dir", p)] + ["--ro-bind", prefix, prefix]
    for f in LOADER_FILES:
        if os.path.exists(f):
            args += ["--ro-bind", f, f]
    args += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(tmp_bytes),
        "--tmpfs",
        "/tmp",
        "--chdir",
        "/tmp",
        "--setenv",
        "HOME",
        "/tmp",
        "--seccomp",
        str(seccomp_fd),
    ]
    return args


def _ancestors(path: str) -> list[str]:
    """/a/b/c -> [/a, /a/b]."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def jailed_python(args: list[str], tmp_bytes: int, network: bool) -> tuple[list[str], int]:
    """The command running ``python -I -S *args`` in the jail, and the read end of the pipe that
    holds its seccomp program (``envs.seccomp``): pass it to the child (``pass_fds``) and close
    it once the child started. A root caller's jail is entered as root, which the bootstrap then
    drops to nobody (``envs.sandbox``)."""
    from spmd_rl.envs.seccomp import program

    read, write = os.pipe()
    os.write(write, program())  # a few hundred bytes: the pipe holds them
    os.close(write)
    exe, _ = python_for_jail()
    return [
        *bwrap_args(bwrap_path(), read, tmp_bytes, network, as_nobody=os.geteuid() == 0),
        exe,
        "-I",
        "-S",
        *args,
    ], read


@functools.cache
def jail_problem() -> str | None:
    """None when a jail can be made here (bubblewrap is installed and can create the namespaces:
    tried once per process), else what is missing."""
    if bwrap_path() is None:
        return "bubblewrap (bwrap) is not installed: apt-get install bubblewrap (launch/setup.sh does)"
    read = None
    try:
        cmd, read = jailed_python(["-c", "pass"], 2**20, network=False)
        res = subprocess.run(
            cmd, pass_fds=(read,), capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"}
        )
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        return f"bubblewrap could not start a jail: {exc}"
    finally:
        if read is not None:
            os.close(read)
    if res.returncode != 0:
        return f"bubblewrap could not start a jail here (user namespaces refused?): {res.stderr.strip()[-300:]}"
    return None
