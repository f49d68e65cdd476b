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
  nothing else of the host: no home, no job directory, no checkpoints, no ``/dev/shm`` of the
  host; a read-only root and ``/dev``, and two private tmpfs of ``tmp_bytes`` each: ``/tmp``
  (its working directory) and ``/dev/shm``;
- no capabilities, ``no_new_privs``, the seccomp filter of ``envs.seccomp``;
- an empty environment but ``PATH`` and the encoding (no job token, no API key).

Per-call limits on the call as a whole (``CallCgroup``), where this process can make a cgroup
(``cgroup_place``, tried once): a child cgroup per call, under this process's own (cgroup v2
where ``memory`` and ``pids`` are delegated to it or to its parent; else cgroup v1's ``memory``
and ``pids`` hierarchies), with ``memory.max`` / ``memory.limit_in_bytes`` (every process of
the call together, tmpfs pages included), no swap, and ``pids.max``. The launcher enters it
before bubblewrap starts, so nothing of the call runs outside it; the call's end kills what is
left in it and removes it. Where none can be made, only the resource limits of each process
hold (``envs.sandbox``: ``RLIMIT_AS`` per process, ``RLIMIT_NPROC`` counted where the call's
tasks are the only ones of their user: the jail's user namespace, or a root caller's uid of the
call's own, ``JAIL_UIDS``).

Resource limits (CPU, memory, processes, file size, open files) are set by the bootstrap inside
(``envs.sandbox``). A process limit binds only a non-root user, so a root caller's jail runs the
code as a uid no other process has (``call_uid``).
"""

from __future__ import annotations

import functools
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

NOBODY = 65534
JAIL_UIDS = (0x7F000000, 2**16)
"""A root caller's calls run as a uid of this range (first, count), one drawn per call: the
kernel counts ``RLIMIT_NPROC`` per uid, host-wide, and no other process should have it (above
the ranges systemd allocates for users and containers, below its foreign range 0x7FFE0000);
should one, the call gets fewer tasks, never more."""
JAIL_TASKS = 3
"""Tasks of a jail before its code runs: bubblewrap, its PID 1 in the jail, the bootstrap."""
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
LOADER_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
CGROUP_PREFIX = "spmd-rl-call-"
_ENTER = 'for f do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; exec "$@"'
"""``sh -c _ENTER sh PROCS... -- CMD...``: write its own pid into each ``cgroup.procs`` file,
then become CMD (a write refused: exit 125)."""
_calls = itertools.count()


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def call_uid() -> int:
    """A uid of ``JAIL_UIDS`` for one call of a root caller."""
    return JAIL_UIDS[0] + secrets.randbelow(JAIL_UIDS[1])


def python_for_jail() -> tuple[str, str]:
    """(the real interpreter file, the prefix it needs): a venv's ``python`` is a link into its
    base prefix, which is what the jail mounts (the child runs with ``-I -S``: no site-packages)."""
    exe = os.path.realpath(sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


def bwrap_args(bwrap: str, seccomp_fd: int, tmp_bytes: int, network: bool, as_root: bool) -> list[str]:
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
        as_root
    ):  # no user namespace (the call's uid must be a real one for the process limit); the bootstrap drops to it
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
        parents = _ancestors(prefix)  # passable to the jail's user, whatever the host's modes (/root is 0700)
        args += [a for p in parents for a in ("--perms", "0755", "--dir", p)] + ["--ro-bind", prefix, prefix]
    for f in LOADER_FILES:
        if os.path.exists(f):
            args += ["--ro-bind", f, f]
    size = str(tmp_bytes)  # each writable tmpfs is sized: bubblewrap's default is half of the host's memory
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]
    args += ["--remount-ro", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/tmp", "--remount-ro", "/"]
    return args + ["--chdir", "/tmp", "--setenv", "HOME", "/tmp", "--seccomp", str(seccomp_fd)]


def _ancestors(path: str) -> list[str]:
    """/a/b/c -> [/a, /a/b]."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def jailed_python(args: list[str], tmp_bytes: int, network: bool) -> tuple[list[str], int]:
    """The command running ``python -I -S *args`` in the jail, and the read end of the pipe that
    holds its seccomp program (``envs.seccomp``): pass it to the child (``pass_fds``) and close
    it once the child started. A root caller's jail is entered as root, which the bootstrap then
    drops to the call's own uid (``envs.sandbox``)."""
    from spmd_rl.envs.seccomp import program

    read, write = os.pipe()
    os.write(write, program())  # a few hundred bytes: the pipe holds them
    os.close(write)
    exe, _ = python_for_jail()
    return [
        *bwrap_args(bwrap_path(), read, tmp_bytes, network, as_root=os.geteuid() == 0),
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


class CallCgroup:
    """One call's cgroup: a directory in the unified hierarchy (``version`` 2), or one in each of
    cgroup v1's ``memory`` and ``pids`` hierarchies, made under ``parents`` with the call's limits
    (module docstring). ``wrap`` a command to start it inside; ``close`` once the call ended."""

    def __init__(self, version: int, parents: tuple[str, ...], memory_bytes: int, tasks: int):
        name = f"{CGROUP_PREFIX}{os.getpid()}-{next(_calls)}"
        self.version, self.dirs = version, [os.path.join(p, name) for p in parents]
        made: list[str] = []
        try:
            for d in self.dirs:
                os.mkdir(d)
                made.append(d)
            self._limit(memory_bytes, tasks)
        except OSError:
            self.dirs = made
            self.close()
            raise

    def _limit(self, memory_bytes: int, tasks: int) -> None:
        if self.version == 2:
            d = self.dirs[0]
            _write(d, "memory.max", memory_bytes)
            _write(d, "pids.max", tasks)
            _write(d, "memory.swap.max", 0, optional=True)
        else:
            memory, pids = self.dirs
            _write(memory, "memory.limit_in_bytes", memory_bytes)
            _write(memory, "memory.memsw.limit_in_bytes", memory_bytes, optional=True)  # no swap (when accounted)
            _write(pids, "pids.max", tasks)

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` started through a shell that enters this cgroup first, then execs it."""
        return ["/bin/sh", "-c", _ENTER, "sh", *(os.path.join(d, "cgroup.procs") for d in self.dirs), "--", *cmd]

    def close(self, wait_s: float = 5.0) -> bool:
        """Kill every task left in it and remove it; False if it could not be removed in ``wait_s``
        (a killed task still exiting: it stays, limits and all)."""
        deadline = time.monotonic() + wait_s
        while self.dirs:
            for d in list(self.dirs):
                if _kill_all(d):
                    continue
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                self.dirs.remove(d)
            if self.dirs and time.monotonic() > deadline:
                return False
            if self.dirs:
                time.sleep(0.01)
        return True


def _write(d: str, name: str, value: int, optional: bool = False) -> None:
    path = os.path.join(d, name)
    if optional and not os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            f.write(str(value))
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, path) from exc


def _kill_all(d: str) -> bool:
    """SIGKILL each task in the cgroup ``d``; whether there were any."""
    try:
        with open(os.path.join(d, "cgroup.procs")) as f:
            pids = [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return False
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return bool(pids)


def _cgroup_candidates() -> list[tuple[int, tuple[str, ...]]]:
    """Where a call's cgroup might be made: (2, (dir,)) under this process's own v2 cgroup or its
    parent, where ``memory`` and ``pids`` are enabled for children; (1, (memory dir, pids dir))
    under its own v1 cgroups."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            hid, controllers, path = line.rstrip("\n").split(":", 2)
            for c in ["2"] if hid == "0" else controllers.split(","):
                own[c] = path
    mounts: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, rest = line.partition(" - ")
            (root, point), (fstype, _, options) = fields.split()[3:5], rest.split()[:3]
            kinds = ["2"] if fstype == "cgroup2" else options.split(",") if fstype == "cgroup" else []
            for c in kinds:
                mounts.setdefault(c, (point, root))
    dirs = {c: _under(mounts[c], own[c]) for c in ("2", "memory", "pids") if c in own and c in mounts}
    out: list[tuple[int, tuple[str, ...]]] = []
    if "2" in dirs:
        for d in (dirs["2"], os.path.dirname(dirs["2"])):
            try:
                with open(os.path.join(d, "cgroup.subtree_control")) as f:
                    if {"memory", "pids"} <= set(f.read().split()):
                        out.append((2, (d,)))
            except OSError:
                pass
    if "memory" in dirs and "pids" in dirs:
        out.append((1, (dirs["memory"], dirs["pids"])))
    return out


def _under(mount: tuple[str, str], path: str) -> str:
    """The directory of the cgroup ``path`` (as /proc/self/cgroup names it) in ``mount`` (its
    mount point, and the cgroup it shows as its root)."""
    point, root = mount
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return os.path.join(point, path.lstrip("/")).rstrip("/")


@functools.cache
def cgroup_place() -> tuple[tuple[int, tuple[str, ...]] | None, str]:
    """(version, parents) where this process can make a call's cgroup, or None; and a line
    saying which, or why none. Tried once per process: a cgroup is made, limited, entered by a
    child, and removed."""
    tried = []
    try:
        candidates = _cgroup_candidates()
    except OSError as exc:
        return None, f"no cgroup can be made: {exc}"
    for version, parents in candidates:
        try:
            cg = CallCgroup(version, parents, 64 * 2**20, 8)
        except OSError as exc:
            tried.append(f"v{version}: {exc.strerror} ({exc.filename})")
            continue
        try:
            res = subprocess.run(cg.wrap(["/bin/true"]), capture_output=True, text=True, timeout=30)
        finally:
            cg.close()
        if res.returncode == 0:
            return (version, parents), f"cgroup v{version} under {', '.join(parents)}"
        tried.append(f"v{version}: a process could not enter it ({res.stderr.strip()[-200:]})")
    why = "; ".join(tried) or "no cgroup v2 with memory and pids delegated here, and no v1 memory and pids hierarchies"
    return None, f"no cgroup can be made: {why}"
