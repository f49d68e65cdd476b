"""The preload server (spmd_rl/launcher/preload.py) with real processes: a stub's copy runs its
program with its argv, environment, working directory and stdio; signals go to the copy and
its end is the stub's; a dead stub takes its copy; a request whose environment a preloaded
import could have read differently, or from another user, runs by itself. The servers here
preload a small module (the mechanism is the same; the suite's own server preloads torch and
vLLM, ``conftest._PreloadServer``), and one serves a real torchrun group."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher import preload
from tests.conftest import REPO, subprocess_env
from tests.preload_servers import COPY_MARK
from tests.torchrun_util import preloaded_copies, wait_for

STUB = """\
from spmd_rl.launcher.preload import delegate
delegate()
import json, os, signal, sys, time
"""


def base_env() -> dict[str, str]:
    env = subprocess_env()
    env.pop(preload.ENV, None)
    return env


class Server:
    def __init__(self, folder: Path, modules: list[str], env: dict[str, str] | None = None):
        folder.mkdir(mode=0o700, exist_ok=True)
        self.socket = str(folder / "s")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-u",
                "-m",
                "spmd_rl.launcher.preload",
                self.socket,
                *modules,
                "--free",
                "PYTEST_CURRENT_TEST",
            ],
            env=env or base_env(),
            cwd=REPO,
            stdin=subprocess.PIPE,
        )
        deadline = time.monotonic() + 30
        while "imported" not in self.log():
            assert self.proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def log(self) -> str:
        path = Path(self.socket + ".log")
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "srv", ["json"])
    yield s
    s.stop()


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "prog.py"
    path.write_text(STUB + textwrap.dedent(body))
    return path


def stub(server: Server | None, prog: Path, *args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    env = (env or base_env()) | ({preload.ENV: server.socket} if server else {preload.ENV: "/nonexistent/s"})
    return subprocess.Popen(
        [sys.executable, str(prog), *args],
        env=env,
        cwd=prog.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


REPORT = """\
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "argv": sys.argv, "cwd": os.getcwd(),
                  "rank": os.environ.get("RANK"), "main": __name__, "path0": sys.path[0],
                  "set_at_import": os.environ.get("SET_AT_IMPORT")}), flush=True)
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def test_the_copy_runs_the_program_with_the_stubs_argv_environment_cwd_and_stdio(server, tmp_path):
    prog = script(tmp_path, REPORT)
    p = stub(server, prog, "a", "b=1", env=base_env() | {"RANK": "5"})  # a per-rank variable may differ
    out, err = p.communicate(timeout=30)
    report = json.loads(out)
    assert p.returncode == 3 and err.strip() == "to stderr"
    assert report["pid"] != p.pid and report["ppid"] == server.proc.pid  # forked by the server, not run by the stub
    assert f"forked {report['pid']}" in server.log()
    assert report["sid"] == report["pid"]  # its own session, as torchrun's workers
    assert report["argv"] == [str(prog), "a", "b=1"] and report["cwd"] == str(tmp_path)
    assert report["rank"] == "5" and report["main"] == "__main__" and report["path0"] == str(tmp_path)


def test_signals_reach_the_copy_and_the_stub_ends_as_it_did(server, tmp_path):
    handled = script(
        tmp_path,
        """\
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
        print(os.getpid(), flush=True)
        time.sleep(60)
    """,
    )
    p = stub(server, handled)
    int(p.stdout.readline())
    p.send_signal(signal.SIGTERM)  # torchrun's killpg reaches the stub's group
    assert p.wait(timeout=15) == 7

    default = script(tmp_path, "print(os.getpid(), flush=True)\ntime.sleep(60)\n")
    p = stub(server, default)
    int(p.stdout.readline())
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=15) == -signal.SIGTERM

    p = stub(server, default)
    copy = int(p.stdout.readline())
    os.kill(copy, signal.SIGKILL)  # the copy killed from outside (OOM killer, a test's kill)
    assert p.wait(timeout=15) == -signal.SIGKILL


def test_the_ranks_of_a_node_fork_from_servers_with_their_own_hash_seeds(tmp_path):
    servers = [Server(tmp_path / f"srv{k}", ["json"]) for k in range(2)]
    try:
        prog = script(tmp_path, 'print(json.dumps({"ppid": os.getppid(), "hash": hash("spmd-rl")}))\n')
        seen = []
        for local_rank in ("0", "1", "2"):
            env = base_env() | {"LOCAL_RANK": local_rank}
            p = subprocess.run(
                [sys.executable, str(prog)],
                env=env | {preload.ENV: os.pathsep.join(s.socket for s in servers)},
                capture_output=True,
                text=True,
                timeout=30,
            )
            seen.append(json.loads(p.stdout))
        assert [r["ppid"] for r in seen] == [servers[0].proc.pid, servers[1].proc.pid, servers[0].proc.pid]
        assert seen[0]["hash"] != seen[1]["hash"] and seen[0]["hash"] == seen[2]["hash"]
    finally:
        for s in servers:
            s.stop()


def test_a_child_spawned_by_multiprocessing_runs_as_itself(server, tmp_path):
    """multiprocessing's spawn method imports the parent's main module in the child as
    ``__mp_main__`` (vLLM's engine core in separated placement): its ``delegate`` call must
    return there, or the child would become another copy of the program."""
    prog = script(
        tmp_path,
        """
        def child(q):
            q.put(os.getpid())

        if __name__ == "__main__":
            import multiprocessing as mp
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            got = q.get(timeout=30)
            p.join(30)
            print(json.dumps({"pid": os.getpid(), "child": got, "exitcode": p.exitcode}), flush=True)
        """,
    )
    p = stub(server, prog)
    out, _ = p.communicate(timeout=90)
    report = json.loads(out)
    assert report["pid"] != p.pid and report["exitcode"] == 0 and report["child"] not in (p.pid, report["pid"])
    assert server.log().count("forked") == 1  # the program's copy, not its spawned child


RACE = """
import os, socket, sys
from spmd_rl.launcher import preload
server = preload.Server(sys.argv[1], set(), sys.stderr)
server.bind()
ours, stub = socket.socketpair()
pid = os.fork()
if pid == 0:
    os._exit(7)
server.children[pid], server.by_conn[ours] = ours, pid
preload._send_frame(stub, {"signal": 15})  # the stub forwards a signal as its copy exits
os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
r, w = os.pipe()
os.close(w)  # the parent's pipe at EOF: serve returns after this round
print(server.serve(until_eof_of=r), preload._recv_frame(stub))
"""


def test_a_stub_whose_copy_exits_in_the_same_round_is_answered_and_the_server_serves_on(tmp_path):
    """One select round sees a stub's frame, then the reaper finds its copy exited, answers the
    stub and closes its connection: the frame is not read from the closed connection (the
    server died of a KeyError there, and every later rank imported by itself)."""
    out = subprocess.run(
        [sys.executable, "-c", RACE, str(tmp_path / "s")],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "{'status':", f"{7 << 8}}}"], out.stdout


def test_a_killed_stub_takes_its_copy_with_it(server, tmp_path):
    prog = script(tmp_path, "print(os.getpid(), flush=True)\ntime.sleep(60)\n")
    p = stub(server, prog)
    copy = int(p.stdout.readline())
    p.kill()
    p.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{copy}").exists() and Path(f"/proc/{copy}/stat").read_text().split(")")[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the copy outlived its stub"
        time.sleep(0.05)


def test_a_copy_is_found_by_the_servers_mark_until_its_stub_dies(tmp_path):
    """``torchrun_util.preloaded_copies``, what the exactly-once test checks for survivors with:
    a copy's /proc environment is its server's, so it carries the mark, not its job's token."""
    s = Server(tmp_path / "srv", ["json"], env=base_env() | {COPY_MARK: str(os.getpid())})
    try:
        prog = script(tmp_path, "print(os.getpid(), flush=True)\ntime.sleep(60)\n")
        p = stub(s, prog, env=base_env() | {"SPMD_RL_JOB_TOKEN": "t0ken"})
        copy = int(p.stdout.readline())
        assert b"SPMD_RL_JOB_TOKEN=t0ken" not in Path(f"/proc/{copy}/environ").read_bytes()
        assert any(line.split()[0] == str(copy) for line in preloaded_copies())
        p.kill()
        p.wait()
        wait_for(lambda: all(line.split()[0] != str(copy) for line in preloaded_copies()), 10, "the copy to go")
    finally:
        s.stop()


def test_a_request_a_preloaded_import_could_see_differently_runs_by_itself(tmp_path):
    (tmp_path / "reads_rank.py").write_text(
        "import os\nRANK_AT_IMPORT = os.environ.get('RANK')\nos.environ['SET_AT_IMPORT'] = '1'\n"
    )
    env = base_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    s = Server(tmp_path / "srv", ["json", "reads_rank"], env=env)
    try:
        assert "['RANK']" in s.log()  # the per-rank variable it looked up is pinned
        prog = script(tmp_path, REPORT)
        for extra, reason in [({"RANK": "1"}, "RANK"), ({"SOME_LIBRARY_FLAG": "1"}, "SOME_LIBRARY_FLAG")]:
            p = stub(s, prog, env=env | extra)
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 3 and json.loads(out)["pid"] == p.pid  # ran in the stub itself
            assert f"refused: {reason} differs" in s.log()
        p = stub(s, prog, env=env | {"OMP_NUM_THREADS": "1", "MASTER_PORT": "1234"})  # applied, per-rank: served
        out, _ = p.communicate(timeout=30)
        report = json.loads(out)
        assert report["pid"] != p.pid
        assert report["set_at_import"] == "1"  # what an import set in its process is set in the copy's too
    finally:
        s.stop()


def test_the_copy_runs_sitecustomize_again_with_its_own_environment_and_argv(tmp_path):
    """A fresh interpreter runs ``sitecustomize`` at start with the rank's environment and argv;
    the server ran it with its own, so the copy runs it again with the request's."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\nsys.customized = getattr(sys, 'customized', []) + [(os.environ.get('SPMD_RL_PLAN'), "
        "sys.orig_argv[-1])]\n"
    )
    env = base_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    s = Server(tmp_path / "srv", ["json"], env=env)
    try:
        prog = script(tmp_path, "print(json.dumps({'pid': os.getpid(), 'customized': sys.customized}), flush=True)\n")
        p = stub(s, prog, "last-arg", env=env | {"SPMD_RL_PLAN": "for-this-rank"})
        out, _ = p.communicate(timeout=30)
        report = json.loads(out)
        assert report["pid"] != p.pid  # the copy printed
        server_run = [None, "PYTEST_CURRENT_TEST"]  # at the server's start: no plan, its own argv's last word
        assert report["customized"] == [server_run, ["for-this-rank", "last-arg"]]
    finally:
        s.stop()


def test_a_program_whose_delegate_a_sitecustomize_wrapped_is_still_forked(tmp_path):
    """The suite's fault plans (tests/helpers/faults/sitecustomize.py) wrap ``delegate`` so
    their plan applies where it returns: the wrapper's own frame must not hide that the program
    is ``__main__``. A check of the immediate caller's module failed here, and every worker
    with a fault plan (each of the node-loss test's nine survivor starts) imported torch and
    vLLM itself; the wrapper must still run its part once, in the copy only."""
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import functools, os, sys
            from spmd_rl.launcher import preload
            if os.environ.get("SPMD_RL_WRAP_DELEGATE"):
                inner = getattr(preload.delegate, "__wrapped__", preload.delegate)

                @functools.wraps(inner)
                def wrapped(*args, **kwargs):
                    inner(*args, **kwargs)
                    sys.applied_in = os.getpid()

                preload.delegate = wrapped
            """
        )
    )
    env = base_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    s = Server(tmp_path / "srv", ["json"], env=env)
    try:
        prog = script(tmp_path, "print(json.dumps({'pid': os.getpid(), 'applied': sys.applied_in}), flush=True)\n")
        p = stub(s, prog, env=env | {"SPMD_RL_WRAP_DELEGATE": "1"})
        out, err = p.communicate(timeout=30)
        report = json.loads(out)
        assert report["pid"] != p.pid and report["applied"] == report["pid"], s.log()  # the copy ran it, and applied
        assert s.log().count("forked") == 1
    finally:
        s.stop()


def ask(path: str, request: object, raw: bytes | None = None) -> dict | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    with open(os.devnull) as null:
        if raw is None:
            preload._send_frame(sock, request, [null.fileno()] * 3)
        else:
            socket.send_fds(sock, [raw], [null.fileno()] * 3)
    try:
        return preload._recv_frame(sock)
    finally:
        sock.close()


def test_a_malformed_request_is_refused_by_name_and_the_server_serves_on(server, tmp_path):
    good = {"argv": ["x.py"], "orig_argv": ["python", "x.py"], "module": None, "cwd": "/", "env": base_env()}
    assert ask(server.socket, good | {"env": {"A": 1}}) == {"refused": "request field(s) env malformed"}
    assert ask(server.socket, good | {"argv": [], "cwd": 3}) == {"refused": "request field(s) argv, cwd malformed"}
    assert ask(server.socket, None, raw=b"\xff\xff\xff\xff") == {
        "refused": f"a request of {2**32 - 1} bytes (at most {preload.MAX_FRAME})"
    }
    prog = script(tmp_path, REPORT)
    p = stub(server, prog)
    out, _ = p.communicate(timeout=30)
    assert json.loads(out)["pid"] != p.pid  # still serving


def test_without_a_server_the_program_runs_by_itself(tmp_path):
    prog = script(tmp_path, REPORT)
    p = stub(None, prog)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 3 and json.loads(out)["pid"] == p.pid


def ask_as_nobody(path: str) -> str:
    """What a process of another user gets from the server: its answer, or the error name."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # only system calls here, then _exit
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            preload._send_frame(sock, {"argv": ["x.py"], "module": None, "cwd": "/", "env": {}}, [0, 1, 2])
            msg = json.dumps(preload._recv_frame(sock))
        except BaseException as e:  # noqa: BLE001 - this forked copy of pytest must reach _exit
            msg = f"{type(e).__name__}: {e}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return f.read()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
def test_only_the_servers_user_is_served():
    folder = Path(tempfile.mkdtemp())  # in /tmp, which every user may enter (pytest's tmp_path is 0700)
    folder.chmod(0o755)
    server = Server(folder / "srv", ["json"])
    try:
        assert ask_as_nobody(server.socket).startswith("PermissionError")  # the server's folder is 0700
        Path(server.socket).parent.chmod(0o755)  # opened up: the server itself refuses the other uid
        Path(server.socket).chmod(0o666)
        answer = ask_as_nobody(server.socket)  # refused before its request is read: the answer, or a closed pipe
        assert answer.startswith(("BrokenPipeError", "ConnectionResetError")) or json.loads(answer).get("refused"), (
            answer
        )
        assert "refused: uid 65534 is not the server's" in server.log() and "forked" not in server.log()
    finally:
        server.stop()
        shutil.rmtree(folder)


def test_mismatch_names_the_first_variable_a_copy_would_differ_in():
    server_env = {"PATH": "/bin", "HF_HOME": "/h"}
    assert (
        preload.mismatch(set(), server_env, server_env | {"RANK": "3", "SPMD_RL_ETCD": "x", "OMP_NUM_THREADS": "1"})
        is None
    )
    assert preload.mismatch({"RANK"}, server_env, server_env | {"RANK": "3"}) == "RANK"
    assert preload.mismatch(set(), server_env, {"PATH": "/bin"}) == "HF_HOME"  # missing counts
    assert preload.mismatch(set(), server_env, server_env | {"PYTEST_CURRENT_TEST": "t"}) == "PYTEST_CURRENT_TEST"
    assert (
        preload.mismatch(
            set(), server_env, server_env | {"PYTEST_CURRENT_TEST": "t"}, frozenset({"PYTEST_CURRENT_TEST"})
        )
        is None
    )


def test_the_environment_recorder_tells_lookups_from_whole_environment_reads(monkeypatch):
    monkeypatch.setattr(preload._RecordedEnviron, "looked_up", set())
    monkeypatch.setenv("RANK", "0")
    cls = os.environ.__class__
    os.environ.__class__ = preload._RecordedEnviron
    try:
        dict(os.environ)
        _ = [k for k, v in os.environ.items()]
        assert "RANK" not in preload._RecordedEnviron.looked_up
        os.environ.get("WORLD_SIZE")
        _ = "LOCAL_RANK" in os.environ
    finally:
        os.environ.__class__ = cls
    assert {
        "WORLD_SIZE",
        "LOCAL_RANK",
    } <= preload._RecordedEnviron.looked_up and "RANK" not in preload._RecordedEnviron.looked_up


@pytest.mark.slow
def test_a_torchrun_group_forks_from_the_server_and_reports_its_ranks_exit(tmp_path):
    s = Server(tmp_path / "srv", ["json"], env=base_env() | QUIET_ENV)  # as train.py declares it sets
    try:
        env = base_env() | {preload.ENV: s.socket, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=2",
                "-m",
                "spmd_rl.train",
                str(tmp_path / "missing.yaml"),
            ],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0 and "INVALID" in out.stderr, out.stderr[-3000:]  # train.py ran in the copies
        assert "exitcode: 2" in out.stderr  # the user error's status reached torchrun through the stubs
        assert s.log().count("forked ") >= 1 and "refused" not in s.log()  # the first to fail has the other stopped
    finally:
        s.stop()
