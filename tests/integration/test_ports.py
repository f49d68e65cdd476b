"""Ports picked before they are bound: a server whose port another process takes in between
picks again instead of failing."""

from __future__ import annotations

import socket
import urllib.request

from spmd_rl.dock import etcd_server
from spmd_rl.dock.etcd_server import EmbeddedEtcd


def test_embedded_etcd_survives_a_stolen_port(monkeypatch):
    """The first two ports handed to etcd are held by another socket (as if a process took them
    between the pick and etcd's bind); etcd starts on the ports picked next."""
    thieves = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        thieves.append(s)
    stolen = [s.getsockname()[1] for s in thieves]
    real = etcd_server.free_port
    handed = list(stolen)
    monkeypatch.setattr(etcd_server, "free_port", lambda host="127.0.0.1": handed.pop(0) if handed else real(host))
    try:
        with EmbeddedEtcd() as etcd:
            assert etcd.client_port not in stolen and etcd.peer_port not in stolen
            assert b"address already in use" in (etcd._log_path()).read_bytes()  # the first try did lose its port
            with urllib.request.urlopen(f"http://{etcd.endpoint}/health", timeout=5) as resp:
                assert b"true" in resp.read()
    finally:
        for s in thieves:
            s.close()


def test_embedded_etcd_on_a_taken_fixed_port_fails_clearly():
    """A client port the caller fixed is not silently replaced: start fails naming it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        etcd = EmbeddedEtcd(client_port=port)
        try:
            etcd.start(timeout_s=20)
        except etcd_server.DockUnavailable as exc:
            assert str(port) in str(exc) and "exited" in str(exc)
        else:
            etcd.stop()
            raise AssertionError("etcd started on a port another socket holds")
    finally:
        s.close()
