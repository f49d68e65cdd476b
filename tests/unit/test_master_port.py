"""Rank 0 holds torchrun's MASTER_PORT through its imports (spmd_rl/distributed/master_port.py):
while held, no other socket can bind the port; once released, the process group's TCPStore
binds it; other ranks hold nothing."""

from __future__ import annotations

import errno
import socket

import pytest
from torch.distributed import TCPStore

from spmd_rl.distributed.master_port import hold_master_port, release_master_port
from spmd_rl.dock.etcd_server import free_port


def _bind(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_rank_0_reserves_the_port_until_the_store_takes_it(monkeypatch):
    port = free_port("127.0.0.1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", str(port))
    held = hold_master_port()
    assert held is not None and held.getsockname()[1] == port
    with pytest.raises(OSError) as refused:  # another process's server (or bind(0), connect) cannot have it
        _bind(port)
    assert refused.value.errno == errno.EADDRINUSE
    release_master_port(held)
    store = TCPStore("127.0.0.1", port, world_size=1, is_master=True, wait_for_workers=False)
    store.set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.parametrize("env", [{"RANK": "1", "MASTER_PORT": "0"}, {"RANK": "0"}, {}])
def test_other_ranks_and_plain_processes_hold_nothing(monkeypatch, env):
    port = free_port("127.0.0.1")
    for k in ("RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, str(port) if k == "MASTER_PORT" else v)
    assert hold_master_port() is None
    _bind(port)  # still free
