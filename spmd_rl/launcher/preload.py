"""Start ranks already past their imports: a preload server forks them from one process that
imported torch, transformers, vLLM and spmd_rl once.

A rank spends about 10 CPU-seconds importing torch (dynamo included), transformers and vLLM
before its first own statement (``python -c "import spmd_rl.train, vllm.entrypoints.llm"``:
10.0 s wall, 9.6 s user, Intel Xeon). Every start pays it again: each rank of each job, each
restart after a failure. ``python -m spmd_rl.launcher.preload SOCKET`` imports them once and
then serves; a rank whose environment names the socket (``SPMD_RL_PRELOAD``) asks it for a
forked copy of itself instead of importing (``delegate``, the first statement of the rank's
program), and stays as a *stub* that stands for the copy:

- the stub sends its stdin, stdout and stderr (``SCM_RIGHTS``), argv, environment and working
  directory as one JSON frame; the server forks, and the child takes them over, starts a new
  session (as torchrun's workers do), and runs the program as ``__main__``;
- signals the stub receives (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2: torchrun's ``killpg``
  reaches the stub's group) are forwarded to the child;
- when the child exits the stub exits the same way (the same code, or killed by the same
  signal), so torchrun sees what it would have seen;
- when the stub dies, SIGKILL included, its end of the socket closes and the server SIGKILLs
  the child: the copy never outlives the process torchrun started.

Invariant: a forked child is the program a fresh interpreter would have run. Whatever the
interpreter, a C library or a Python module reads from the environment while it starts or is
imported is fixed in the server, so the server refuses a request whose environment differs
from its own in any variable but the ones torchrun and ``spmd-rl train`` set per rank
(``RANK_VARIABLES``, ``SPMD_RL_*``, ``TORCHELASTIC_*``), and refuses those too where its
imports looked one up (it records every lookup, misses included). ``OMP_NUM_THREADS`` is
applied in the child (``torch.set_num_threads``). The server imports only libraries, never
the program itself: the child runs the program's module-level code fresh. What a fresh
interpreter runs at start with the rank's environment and argv, ``sitecustomize`` and
``usercustomize``, the child runs again with the request's (``sys.orig_argv`` included), after
the server ran them with its own: they must bear running twice, as ``site`` does not guard them
either. A refused or
unreachable server costs nothing but the time: ``delegate`` returns and the rank imports and
runs by itself.

Only the server's own user may connect (``SO_PEERCRED``; the socket's folder is 0700): the
socket runs programs. Frames are JSON, never pickle. Tested on CPU (tests/integration/test_preload.py); a
server must never initialise CUDA before it forks, and importing torch does not.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import struct
import sys

LIBRARIES = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "transformers",
    "tensordict",
    "vllm.entrypoints.llm",
    "vllm.entrypoints.launchers.cli_args",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.cpu_worker",
    "vllm.model_executor.layers.quantization.online.base",
    "torch.distributed.checkpoint",
    "spmd_rl.engines.vllm.cpu_kernels:register_once",  # vLLM's CPU kernel fallbacks, once for every rank
)
"""What a server for this project's ranks imports (its ``modules`` arguments): the libraries a
rank spends its start importing, and the one warm-up each rank would repeat. Past
``vllm.entrypoints.llm``, building an engine imports its worker (CPU: ``cpu_worker``, which
imports ``gpu_worker``, 0.44 s), its loader's quantization hooks and its argument parser, and the
training engine imports distributed checkpointing: 0.75 s of every rank's start, measured by
importing each after the rest (2-core AMD EPYC)."""

ENV = "SPMD_RL_PRELOAD"
"""The preload server's socket path, or several joined with ``os.pathsep``: a rank asks the one
at its ``LOCAL_RANK`` modulo their number. Unset: every rank imports for itself.

Why several: each interpreter draws its own string-hash seed, so the iteration order of a set
of strings differs between fresh ranks, and copies of one server would all share its seed. A
code path whose collectives follow such an order would hang fresh ranks and pass on copies;
with one server per local rank, the ranks of a node differ in their seeds as fresh ones do."""

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
RANK_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "_",
        "SHLVL",
        "PWD",
        "OLDPWD",
    }
)
RANK_PREFIXES = ("SPMD_RL_", "TORCHELASTIC_")
"""What torchrun's agent (``LocalElasticAgent._start_workers``), ``spmd-rl train`` and a shell
(the command run, its depth, the folder) set per rank, job or command: a child may differ in
these unless the server's imports looked one up."""
APPLIED = frozenset({"OMP_NUM_THREADS", "PYTHONUNBUFFERED"})
"""Variables a child may always differ in: the thread count it applies itself, and the
server's unbuffered stdio (never wrong, only unbatched)."""

MAX_FRAME = 16 << 20
"""The largest request a server reads (an environment is kilobytes)."""
READ_TIMEOUT_S = 10.0
"""How long the server waits for the rest of a frame: one stuck client must not hold up the
others (the server is one thread)."""

_in_server_or_child = False
"""True in the server and in every copy it forks: the copy runs the program, whose
``delegate`` call must then return at once."""


def _send_frame(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


def _recv_exact(sock: socket.socket, n: int, buf: bytes = b"") -> bytes | None:
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _recv_frame(sock: socket.socket) -> dict | None:
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    size = struct.unpack("!I", head)[0]
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes (at most {MAX_FRAME})")
    body = _recv_exact(sock, size)
    return None if body is None else json.loads(body)


def _check_request(request: object) -> dict:
    """The request, if it has the shape ``delegate`` sends; ValueError naming what is wrong."""
    if not isinstance(request, dict):
        raise ValueError("the frame is not a request")
    strings = lambda xs: all(isinstance(x, str) for x in xs)  # noqa: E731
    checks = {
        "argv": isinstance(request.get("argv"), list) and request["argv"] and strings(request["argv"]),
        "orig_argv": isinstance(request.get("orig_argv"), list) and strings(request["orig_argv"]),
        "module": request.get("module") is None or isinstance(request["module"], str),
        "cwd": isinstance(request.get("cwd"), str),
        "env": isinstance(request.get("env"), dict) and strings(request["env"]) and strings(request["env"].values()),
    }
    bad = [field for field, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"request field(s) {', '.join(bad)} malformed")
    return request


# ---------------------------------------------------------------- the rank's side: the stub


def delegate(module: str | None = None, sets: dict[str, str] | None = None) -> None:
    """Become the stub of a forked copy of this program when ``$SPMD_RL_PRELOAD`` names a
    server that accepts; return at once otherwise (no server, refused, or this already is the
    copy). ``module``: the program as ``python -m`` runs it; None: the script ``sys.argv[0]``.
    ``sets``: variables the program sets itself before it imports anything that reads them
    (they are part of the environment compared, and the copy's). Never returns once a copy
    runs: the stub exits as the copy did.

    Only a program's start delegates: where the module whose top-level code leads to this call
    (the nearest ``<module>`` frame up the stack) is not ``__main__`` (imported, or imported
    again as ``__mp_main__`` in a child that multiprocessing's spawn method started, as vLLM's
    engine core is), this returns, and that process runs as itself. Functions between that
    frame and this one, such as a wrapper the test suite's fault plans put around ``delegate``,
    do not change the answer."""
    paths = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    if not paths or _in_server_or_child or not _called_from_main():
        return
    local_rank = os.environ.get("LOCAL_RANK", "0")
    path = paths[int(local_rank) % len(paths)] if local_rank.isdigit() else paths[0]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        request = {
            "argv": sys.argv,
            "orig_argv": sys.orig_argv,
            "module": module,
            "cwd": os.getcwd(),
            "env": dict(os.environ) | (sets or {}),
        }
        _send_frame(sock, request, [0, 1, 2])
        answer = _recv_frame(sock)
    except OSError:
        answer = None
    if not answer or "pid" not in answer:  # no server, or refused (the reason is in the server's log)
        sock.close()
        return
    _stand_in(sock)


def _called_from_main() -> bool:
    """Whether the nearest module-level frame above ``delegate`` runs as ``__main__``."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != "<module>":
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__") == "__main__"


def _stand_in(sock: socket.socket) -> None:
    def forward(signum, _frame):
        try:
            _send_frame(sock, {"signal": signum})
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        status = _recv_frame(sock)
    except OSError:
        status = None
    if status is None:  # the server died: the copy died with it (its session is gone)
        os._exit(1)
    code = os.waitstatus_to_exitcode(status["status"])
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        if -code in FORWARDED:  # the handler forwarding it; SIGKILL and the rest end the stub as they are
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal this process cannot receive (SIGSTOP never is one)
    os._exit(code)


# ---------------------------------------------------------------- the server


class _RecordedEnviron(os._Environ):  # type: ignore[name-defined]
    """``os.environ`` while the server imports: remembers every name looked up by name. Reads
    of the whole environment are not lookups of one name (what they see is covered by the
    equality rule): those while it is iterated (``items()``: tqdm, networkx) and a copy's
    (``dict(os.environ)``: ``platform``), which reads every name in ``keys()`` order right
    after ``keys()``; a lookup out of that order is recorded and ends the copy."""

    looked_up: set[str] = set()
    iterating = 0
    copying: list[str] = []

    def __iter__(self):
        _RecordedEnviron.iterating += 1
        try:
            yield from super().__iter__()
        finally:
            _RecordedEnviron.iterating -= 1

    def keys(self):
        _RecordedEnviron.copying = list(super().__iter__())[::-1]  # popped from the end, in order
        return super().keys()

    def __getitem__(self, key):
        copying = _RecordedEnviron.copying
        if copying and copying[-1] == key:
            copying.pop()
        elif not _RecordedEnviron.iterating:
            copying.clear()
            _RecordedEnviron.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        _RecordedEnviron.looked_up.add(key)
        return super().__contains__(key)


def preload(modules: list[str]) -> set[str]:
    """Import ``modules`` and return the environment names they looked up. An entry
    ``module:function`` also calls that function (no arguments) once imported: a warm-up every
    child would otherwise repeat."""
    global _in_server_or_child
    _in_server_or_child = True
    cls = os.environ.__class__
    os.environ.__class__ = _RecordedEnviron
    try:
        for name in modules:
            module, _, call = name.partition(":")
            __import__(module)
            if call:
                getattr(sys.modules[module], call)()
    finally:
        os.environ.__class__ = cls
    return {k for k in _RecordedEnviron.looked_up if isinstance(k, str)}


def mismatch(
    looked_up: set[str], server_env: dict[str, str], env: dict[str, str], free: frozenset[str] = frozenset()
) -> str | None:
    """The first variable in which a child would differ from a fresh interpreter, else None:
    every variable must equal the server's but those in ``APPLIED`` and the per-rank ones (and
    ``free``, the server's ``--free`` names) its imports did not look up. (A library may read
    any variable, also by iterating over the environment, so nothing else may differ.)"""
    per_run = RANK_VARIABLES | free
    for name in sorted({*server_env, *env}):
        free_here = name in APPLIED or ((name in per_run or name.startswith(RANK_PREFIXES)) and name not in looked_up)
        if not free_here and server_env.get(name) != env.get(name):
            return name
    return None


class Server:
    """The accept loop: one connection per stub, one forked child per connection."""

    def __init__(self, path: str, looked_up: set[str], log, free: frozenset[str] = frozenset()):
        self.path, self.looked_up, self.log, self.free = path, looked_up, log, free
        self.env = dict(os.environ)  # as a fresh interpreter starts: what requests are compared with
        self.imports_set: dict[str, str | None] = {}  # what the imports changed in it (None: removed)
        self.children: dict[int, socket.socket] = {}  # child pid -> its stub's connection
        self.by_conn: dict[socket.socket, int] = {}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def bind(self) -> None:
        self.listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self.listener.listen(64)

    def serve(self, until_eof_of: int):
        """Serve until the file descriptor ``until_eof_of`` (the parent's pipe) reads EOF;
        in a forked child, return the request it is to run."""
        server_pid = os.getpid()
        try:
            while True:
                watched = [self.listener, *self.by_conn, until_eof_of]
                ready, _, _ = select.select(watched, [], [], 0.05)
                self._reap()
                for item in ready:
                    if item is self.listener:
                        request = self._accept()
                        if request is not None:  # this is the forked child
                            return request
                    elif item == until_eof_of:
                        if not os.read(until_eof_of, 4096):
                            return None
                    elif item in self.by_conn:  # not if _reap has just closed it (its copy exited)
                        self._from_stub(item)
        finally:
            if os.getpid() == server_pid:
                for pid in self.children:
                    _kill(pid, signal.SIGKILL)
                self.listener.close()

    def _accept(self):
        conn, _ = self.listener.accept()
        conn.settimeout(READ_TIMEOUT_S)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        fds: list[int] = []
        request: dict = {}
        try:
            if uid != os.getuid():
                raise ValueError(f"uid {uid} is not the server's")
            head, fds, _, _ = socket.recv_fds(conn, 4, 3)
            if len(head) < 4 or len(fds) != 3:
                raise ValueError("the first frame must carry stdin, stdout and stderr")
            size = struct.unpack("!I", head[:4])[0]
            if size > MAX_FRAME:
                raise ValueError(f"a request of {size} bytes (at most {MAX_FRAME})")
            request = _check_request(json.loads(_recv_exact(conn, size, head[4:]) or b"null"))
            differs = mismatch(self.looked_up, self.env, request["env"], self.free)
            if differs:
                raise ValueError(f"{differs} differs from the server's")
        except (OSError, ValueError) as e:
            test = request.get("env", {}).get("PYTEST_CURRENT_TEST", "")  # where a test suite runs it
            where = f" | {' '.join(request['argv'][:2])}{'; ' + test if test else ''}" if request else ""
            print(f"refused: {e}{where}", file=self.log, flush=True)
            for fd in fds:
                os.close(fd)
            try:
                _send_frame(conn, {"refused": str(e)})
            except OSError:
                pass
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.listener.close()
            for other in self.by_conn:
                other.close()
            conn.close()
            request["fds"] = fds
            request["imports_set"] = self.imports_set
            return request
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self.by_conn[conn] = pid
        print(f"forked {pid}: {' '.join(request['argv'][:2])}", file=self.log, flush=True)
        _send_frame(conn, {"pid": pid})
        return None

    def _from_stub(self, conn: socket.socket) -> None:
        pid = self.by_conn[conn]
        try:
            message = _recv_frame(conn)
        except (OSError, ValueError):
            message = None
        if message is None:  # the stub died: its copy goes with it
            _kill(pid, signal.SIGKILL)
            del self.by_conn[conn]
            conn.close()
        elif message.get("signal") in {int(s) for s in FORWARDED}:
            _kill(pid, message["signal"])

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None and conn in self.by_conn:
                del self.by_conn[conn]
                try:
                    _send_frame(conn, {"status": status})
                except OSError:
                    pass
                conn.close()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _customize_again() -> None:
    """Run the start-up customization modules the server's interpreter ran (``site`` imports
    ``sitecustomize`` and ``usercustomize`` where they exist) again, now with the child's
    environment and argv, as the rank's own interpreter would have run them; an error is
    reported as ``site`` reports it and the program runs on."""
    import importlib
    import traceback

    for name in ("sitecustomize", "usercustomize"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            try:
                importlib.reload(module)
            except Exception:
                print(f"Error in {name}; the copy runs on without it:", file=sys.stderr)
                traceback.print_exc()


def run_child(request: dict) -> int:
    """In the forked child: become the stub's program and run it; its exit code."""
    import runpy
    import traceback

    os.setsid()
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in request["imports_set"].items():  # as the imports would have changed the rank's own
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.chdir(request["cwd"])
    threads = request["env"].get("OMP_NUM_THREADS", "")
    if threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    sys.argv, sys.orig_argv = list(request["argv"]), list(request["orig_argv"])
    sys.path[0] = os.getcwd() if request["module"] else os.path.dirname(os.path.abspath(sys.argv[0]))
    _customize_again()
    try:
        if request["module"]:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main(argv: list[str]) -> None:
    """Import the modules, then serve on SOCKET until stdin closes; the log (one line per fork
    or refusal) is SOCKET + ".log"."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -u -m spmd_rl.launcher.preload", description=main.__doc__)
    ap.add_argument("socket", help="the socket's path, in a folder only this user can enter")
    ap.add_argument(
        "modules",
        nargs="+",
        help="what to import before forking (libraries, not the program); module:function also calls it",
    )
    ap.add_argument(
        "--free",
        action="append",
        default=[],
        metavar="NAME",
        help="a variable a request may differ in, like the per-rank ones (unless an import looked it up)",
    )
    args = ap.parse_args(argv)
    with open(args.socket + ".log", "a") as log:
        server = Server(args.socket, set(), log, frozenset(args.free))
        server.bind()  # first: a stub connecting during the imports waits in the backlog
        server.looked_up = preload(args.modules)
        after = dict(os.environ)
        server.imports_set = {k: after.get(k) for k in {*server.env, *after} if server.env.get(k) != after.get(k)}
        gc.collect()
        gc.freeze()  # the children's collections leave the imported heap's pages shared
        pinned = sorted(k for k in server.looked_up if k in RANK_VARIABLES | server.free or k.startswith(RANK_PREFIXES))
        print(
            f"imported {' '.join(args.modules)}; per-rank variables they looked up (requests must match): {pinned}",
            file=log,
            flush=True,
        )
        request = server.serve(until_eof_of=0)
    if request is None:  # the server's end: no interpreter finalization (some bindings complain at it)
        sys.stdout.flush()
        os._exit(0)
    sys.exit(run_child(request))


if __name__ == "__main__":  # run as the importable module, whose flag delegate() reads
    from spmd_rl.launcher import preload as _module

    _module.main(sys.argv[1:])
